"""The Talker side of one session: its KV cache, the user parts it keeps across turns, and one frame per step
(code 0 from the Talker, codes 1-15 from the code predictor)."""
from __future__ import annotations

import numpy as np
import torch

from .graphs import CapturedStep, HostCopy, PaddedPrefill, replay_at
from .kv_cache import StaticKVCache
from .sampling import Sampling, choose, gumbel_noise
from .stack import explicit_positions, run_stack


class TalkerState:
    """On the GPU a frame never waits on the host: code 0 is chosen on the device (its repetition penalty reads a
    device mask of the codes chosen so far), the code predictor reads it from there, and the frame's codes feed
    Code2Wav and the next Talker step as a device tensor. Code 0 travels to the host beside that work
    (`code0_value`), for the end-of-speech check."""

    def __init__(self, model, max_len: int, graphs: bool = False, fused_sampling: bool = False) -> None:
        self.talker = model.talker
        self.config = model.config.talker_config
        param = next(self.talker.parameters())
        self.cache = StaticKVCache.for_config(self.config.text_config, max_len, param.dtype, param.device)
        predictor = self.talker.code_predictor
        self.predictor_cache = StaticKVCache.for_config(predictor.config, self.config.num_code_groups + 1,
                                                        param.dtype, param.device)
        vocab = self.config.text_config.vocab_size
        self.suppress = torch.zeros(1, vocab, dtype=torch.bool, device=param.device)  # codes never chosen as code 0
        self.suppress[0, vocab - 1024:] = True
        self.suppress[0, self.config.codec_eos_token_id] = False
        self.seen = torch.zeros_like(self.suppress)  # code 0s of this answer: the repetition penalty's history
        self.user_length = 0  # positions of the cache that hold user parts (kept across turns)
        self.last_hidden: torch.Tensor | None = None  # [1, 1, hidden] output at the last position
        self._code0 = HostCopy((1, 1), torch.long, param.device)
        self._no_noise = {n: torch.zeros(n, device=param.device) for n in (vocab, self._residual_noise_size())}
        self._steps: dict[Sampling, CapturedStep] = {}
        self._prefill: PaddedPrefill | None = None
        self._predictor_graphs: dict[Sampling, CapturedStep] = {}
        self.graphs = graphs
        self.fused_sampling = fused_sampling  # draws with sampling.sample_triton (CUDA)
        if graphs:
            self._prefill = PaddedPrefill(lambda e: self._talker_logits(e, graph_mode=True), self.cache,
                                          self.config.text_config.hidden_size, param.dtype)

    def _residual_noise_size(self) -> int:
        return (self.config.num_code_groups - 1) * self.config.code_predictor_config.vocab_size

    def capture(self, talker_sampling: Sampling, predictor_sampling: Sampling) -> None:
        """CUDA graphs for one frame under these sampling settings: the Talker step with its code-0 choice, and
        all 15 code-predictor steps with theirs."""
        self._captured_step(talker_sampling)
        self._captured_predictor(predictor_sampling)

    def _captured_step(self, sampling: Sampling) -> CapturedStep:
        if sampling not in self._steps:
            groups, hidden = self.config.num_code_groups, self.config.text_config.hidden_size
            codes = torch.zeros(groups, dtype=torch.long, device=self.suppress.device)
            text = self.cache.keys[0].new_zeros(1, 1, hidden)
            seen = self.seen.clone()
            self.cache.position.fill_(self.cache.length)  # the capture's writes land past the context: scratch
            self._steps[sampling] = CapturedStep(
                lambda c, t, n: self._frame_step(c, t, n, sampling, graph_mode=True), codes, text,
                self._no_noise[self.suppress.shape[1]])
            self.seen.copy_(seen)
        return self._steps[sampling]

    def _captured_predictor(self, sampling: Sampling) -> CapturedStep:
        if sampling not in self._predictor_graphs:
            hidden = self.cache.keys[0].new_zeros(1, 1, self.config.text_config.hidden_size)
            code0 = torch.zeros(1, 1, dtype=torch.long, device=hidden.device)
            self._predictor_graphs[sampling] = CapturedStep(
                lambda h, c, n: self._predict(h, c, sampling, n, graph_mode=True), hidden, code0,
                self._no_noise[self._residual_noise_size()])
        return self._predictor_graphs[sampling]

    def _run(self, embeds: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Talker layers over `embeds` at the end of the cache (at TMRoPE `positions` if given), through a graph
        where one fits."""
        if positions is None and self._prefill is not None and self._prefill.fits(embeds.shape[1]):
            return self._prefill(embeds)
        return self._talker_logits(embeds, positions=positions)

    def _talker_logits(self, embeds: torch.Tensor, graph_mode: bool = False,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, _ = run_stack(self.talker.model, embeds, self.cache, mrope=True, graph_mode=graph_mode,
                              positions=positions)
        return hidden, self.talker.codec_head(hidden)

    def _choose_code0(self, logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor) -> torch.Tensor:
        """Code 0 [1, 1] from the Talker's logits at one position, on the device; it joins the penalty's history."""
        code0 = choose(logits, sampling, seen=self.seen, suppress=self.suppress, noise=noise.view(1, -1),
                       fused=self.fused_sampling).view(1, 1)
        self.seen.scatter_(1, code0, True)
        return code0

    def _frame_step(self, codes: torch.Tensor, text: torch.Tensor, noise: torch.Tensor, sampling: Sampling,
                    graph_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The last frame's codes [16] plus one text position in; the last hidden state and code 0 out."""
        hidden, logits = self._talker_logits(self.codec_embedding_sum(codes) + text, graph_mode=graph_mode)
        return hidden, self._choose_code0(logits[:, -1], sampling, noise)

    def _predict(self, last_hidden: torch.Tensor, code0: torch.Tensor, sampling: Sampling, noise: torch.Tensor,
                 graph_mode: bool = False) -> torch.Tensor:
        """Codes 1..15 [15] from the Talker's last hidden state and code 0: step 0 reads [hidden, embed(code 0)],
        step g reads codec_embedding[g-1](code g); each step has its own lm_head."""
        predictor, cache = self.talker.code_predictor, self.predictor_cache
        noise = noise.view(self.config.num_code_groups - 1, -1)
        cache.crop(0)
        code, codes = code0, []
        for group in range(self.config.num_code_groups - 1):
            if group == 0:
                embeds = torch.cat((last_hidden, self.talker.get_input_embeddings()(code)), dim=1)
            else:
                embeds = predictor.model.codec_embedding[group - 1](code)
            if graph_mode:
                cache.position.fill_(0 if group == 0 else group + 1)
            hidden, _ = run_stack(predictor.model, embeds, cache, mrope=False, graph_mode=graph_mode)
            code = choose(predictor.lm_head[group](hidden[:, -1]), sampling, noise=noise[group:group + 1],
                          fused=self.fused_sampling).view(1, 1)
            codes.append(code)
        return torch.cat(codes, dim=1)[0]

    def next_user_position(self) -> int:
        """Rotary position where the next user part goes (the assistant part of an answer is dropped first)."""
        self.cache.crop(self.user_length)
        return self.cache.next_position

    def prefill_user_part(self, embeds: torch.Tensor, positions: np.ndarray) -> None:
        """Append a piece of a user turn (Talker input embeddings [1, T, hidden] at rotary `positions` [3, T]) to
        the kept user context."""
        self.cache.crop(self.user_length)
        self._run(embeds, explicit_positions(positions, self.cache))
        self.user_length = self.cache.length

    def end_answer(self) -> None:
        self.cache.crop(self.user_length)
        self.last_hidden = None

    def start_answer(self, role_embeds: torch.Tensor, first_text: torch.Tensor, tts: dict[str, torch.Tensor],
                     speaker_id: int, sampling: Sampling, generator) -> torch.Tensor:
        """Prefill the 9-position assistant prefix and return code 0 of the first frame ([1, 1], on the device).

        Text side: the 3 role tokens, 4 x tts_pad, tts_bos, the first text token (all through text_projection).
        Codec side: zeros under the role tokens, then nothink, think_bos, think_eos, speaker, codec_pad, codec_bos.
        """
        cfg = self.config
        text = torch.cat((role_embeds, tts["pad"].expand(1, 4, -1), tts["bos"], first_text), dim=1)
        codec_ids = torch.tensor([[cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id, speaker_id,
                                   cfg.codec_pad_id, cfg.codec_bos_id]], device=text.device)
        codec = torch.cat((text.new_zeros(1, 3, text.shape[-1]), self.talker.get_input_embeddings()(codec_ids)), dim=1)
        self.cache.crop(self.user_length)
        self.seen.zero_()
        hidden, logits = self._run(text + codec)
        self.last_hidden = hidden[:, -1:].clone()
        noise = self._noise(sampling, self.suppress.shape[1], generator)
        return self._code0_out(self._choose_code0(logits[:, -1], sampling, noise))

    def step(self, codes: torch.Tensor, text: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
        """One Talker step: the last frame's codes [16] plus one text position in, the next frame's code 0 out
        ([1, 1], on the device)."""
        noise = self._noise(sampling, self.suppress.shape[1], generator)
        if self.graphs:
            self.last_hidden, code0 = replay_at(self._captured_step(sampling), self.cache, 1, codes, text, noise)
        else:
            self.last_hidden, code0 = self._frame_step(codes, text, noise, sampling)
        return self._code0_out(code0)

    def _code0_out(self, code0: torch.Tensor) -> torch.Tensor:
        self._code0.start(code0)
        return code0

    def code0_value(self) -> int:
        """Code 0 of the latest step on the host; waits for that step only, not for work queued after it."""
        return int(self._code0.get())

    def frame_codes(self, code0: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
        """All 16 codes of the frame whose code 0 was just chosen ([16], on the device)."""
        noise = self._noise(sampling, self._residual_noise_size(), generator)
        if self.graphs:
            residual = self._captured_predictor(sampling)(self.last_hidden, code0, noise)
        else:
            residual = self._predict(self.last_hidden, code0, sampling, noise)
        return torch.cat((code0.view(1), residual))

    def _noise(self, sampling: Sampling, size: int, generator) -> torch.Tensor:
        """Gumbel noise [size] for the Talker's choice (one vocabulary) or the predictor's (15); zeros when greedy
        (never read then)."""
        if sampling.greedy:
            return self._no_noise[size]
        return gumbel_noise((size,), generator, self.suppress.device)

    def codec_embedding_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of one frame (codes [16]) [1, 1, hidden], the Talker's input for the
        next step."""
        ids = codes.view(-1, 1, 1)
        parts = [self.talker.get_input_embeddings()(ids[0])]
        parts += [emb(ids[g + 1]) for g, emb in enumerate(self.talker.code_predictor.model.codec_embedding)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True)
