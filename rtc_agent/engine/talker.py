"""The Talker side of one session: its KV cache, the user parts it keeps across turns, and one frame per step
(code 0 from the Talker, codes 1-15 from the code predictor)."""
from __future__ import annotations

import numpy as np
import torch

from .graphs import CapturedStep, PaddedPrefill, replay_at
from .kv_cache import StaticKVCache
from .sampling import Sampling, choose, gumbel_noise
from .stack import explicit_positions, run_stack


class TalkerState:
    def __init__(self, model, max_len: int, graphs: bool = False) -> None:
        self.talker = model.talker
        self.config = model.config.talker_config
        param = next(self.talker.parameters())
        self.cache = StaticKVCache.for_config(self.config.text_config, max_len, param.dtype, param.device)
        predictor = self.talker.code_predictor
        self.predictor_cache = StaticKVCache.for_config(predictor.config, self.config.num_code_groups + 1,
                                                        param.dtype, param.device)
        vocab = self.config.text_config.vocab_size
        suppressed = [i for i in range(vocab - 1024, vocab) if i != self.config.codec_eos_token_id]
        self.suppress = torch.tensor(suppressed, device=param.device)
        self.user_length = 0  # positions of the cache that hold user parts (kept across turns)
        self.last_hidden: torch.Tensor | None = None  # [1, 1, hidden] output at the last position
        self.code0_history: list[int] = []
        self._step: CapturedStep | None = None
        self._prefill: PaddedPrefill | None = None
        self._predictor_graphs: dict[Sampling, CapturedStep] = {}
        self.graphs = graphs
        if graphs:
            self._capture(param)

    def _capture(self, param: torch.Tensor) -> None:
        """CUDA graphs for the one-position Talker step and short prefills."""
        hidden = param.new_zeros(1, 1, self.config.text_config.hidden_size)
        self._step = CapturedStep(lambda e: self._talker_logits(e, graph_mode=True), hidden)
        self._prefill = PaddedPrefill(lambda e: self._talker_logits(e, graph_mode=True), self.cache,
                                      self.config.text_config.hidden_size, param.dtype)

    def capture_predictor(self, sampling: Sampling) -> CapturedStep:
        """All 15 code-predictor steps, sampling included, as one CUDA graph (one per sampling setting)."""
        if sampling not in self._predictor_graphs:
            hidden = self.cache.keys[0].new_zeros(1, 1, self.config.text_config.hidden_size)
            code0 = torch.zeros(1, 1, dtype=torch.long, device=hidden.device)
            noise = torch.zeros(self.config.num_code_groups - 1, self.config.code_predictor_config.vocab_size,
                                device=hidden.device)
            self._predictor_graphs[sampling] = CapturedStep(
                lambda h, c, n: self._predict(h, c, sampling, n, graph_mode=True), hidden, code0, noise)
        return self._predictor_graphs[sampling]

    def _run(self, embeds: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Talker layers over `embeds` at the end of the cache (at TMRoPE `positions` if given), through a graph
        where one fits."""
        if positions is None and self._step is not None and embeds.shape[1] == 1:
            return replay_at(self._step, self.cache, 1, embeds)
        if positions is None and self._prefill is not None and self._prefill.fits(embeds.shape[1]):
            return self._prefill(embeds)
        return self._talker_logits(embeds, positions=positions)

    def _talker_logits(self, embeds: torch.Tensor, graph_mode: bool = False,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, _ = run_stack(self.talker.model, embeds, self.cache, mrope=True, graph_mode=graph_mode,
                              positions=positions)
        return hidden, self.talker.codec_head(hidden)

    def _predict(self, last_hidden: torch.Tensor, code0: torch.Tensor, sampling: Sampling, noise: torch.Tensor,
                 graph_mode: bool = False) -> torch.Tensor:
        """Codes 1..15 [15] from the Talker's last hidden state and code 0: step 0 reads [hidden, embed(code 0)],
        step g reads codec_embedding[g-1](code g); each step has its own lm_head."""
        predictor, cache = self.talker.code_predictor, self.predictor_cache
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
            code = choose(predictor.lm_head[group](hidden[:, -1]), sampling, noise=noise[group:group + 1]).view(1, 1)
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
        self.code0_history = []

    def start_answer(self, role_embeds: torch.Tensor, first_text: torch.Tensor, tts: dict[str, torch.Tensor],
                     speaker_id: int, sampling: Sampling, generator) -> int:
        """Prefill the 9-position assistant prefix and return code 0 of the first frame.

        Text side: the 3 role tokens, 4 x tts_pad, tts_bos, the first text token (all through text_projection).
        Codec side: zeros under the role tokens, then nothink, think_bos, think_eos, speaker, codec_pad, codec_bos.
        """
        cfg = self.config
        text = torch.cat((role_embeds, tts["pad"].expand(1, 4, -1), tts["bos"], first_text), dim=1)
        codec_ids = torch.tensor([[cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id, speaker_id,
                                   cfg.codec_pad_id, cfg.codec_bos_id]], device=text.device)
        codec = torch.cat((text.new_zeros(1, 3, text.shape[-1]), self.talker.get_input_embeddings()(codec_ids)), dim=1)
        self.cache.crop(self.user_length)
        return self._forward(text + codec, sampling, generator)

    def _forward(self, embeds: torch.Tensor, sampling: Sampling, generator) -> int:
        hidden, logits = self._run(embeds)
        self.last_hidden = hidden[:, -1:].clone()
        logits = logits[:, -1]
        previous = torch.tensor([self.code0_history], device=logits.device) if self.code0_history else None
        code0 = int(choose(logits, sampling, generator, previous, self.suppress))
        self.code0_history.append(code0)
        return code0

    def residual_codes(self, code0: int, sampling: Sampling, generator) -> list[int]:
        """Codes 1..15 of the frame whose code 0 was just chosen (one host synchronisation)."""
        code = torch.tensor([[code0]], device=self.last_hidden.device)
        shape = (self.config.num_code_groups - 1, self.config.code_predictor_config.vocab_size)
        noise = gumbel_noise(shape, generator, code.device)
        if self.graphs:
            return self.capture_predictor(sampling)(self.last_hidden, code, noise).tolist()
        return self._predict(self.last_hidden, code, sampling, noise).tolist()

    def codec_embedding_sum(self, codes: list[int]) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of one frame [1, 1, hidden], the Talker's input for the next step."""
        ids = torch.tensor(codes, device=self.suppress.device).view(-1, 1, 1)
        parts = [self.talker.get_input_embeddings()(ids[0])]
        parts += [emb(ids[g + 1]) for g, emb in enumerate(self.talker.code_predictor.model.codec_embedding)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True)

    def step(self, codes: list[int], text: torch.Tensor, sampling: Sampling, generator) -> int:
        """One Talker step: the last frame's codes plus one text position in, the next frame's code 0 out."""
        return self._forward(self.codec_embedding_sum(codes) + text, sampling, generator)
