"""The Talker side of one session: its KV cache, the user parts it keeps across turns, and one frame per step
(code 0 from the Talker, codes 1-15 from the code predictor)."""
from __future__ import annotations

import torch

from .kv_cache import StaticKVCache
from .sampling import Sampling, choose
from .stack import run_stack


class TalkerState:
    def __init__(self, model, max_len: int) -> None:
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

    def prefill_user_part(self, embeds: torch.Tensor) -> None:
        """Append a piece of a user turn (Talker input embeddings [1, T, hidden]) to the kept user context."""
        self.cache.crop(self.user_length)
        run_stack(self.talker.model, embeds, self.cache, mrope=True)
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
        hidden, _ = run_stack(self.talker.model, embeds, self.cache, mrope=True)
        self.last_hidden = hidden[:, -1:]
        logits = self.talker.codec_head(self.last_hidden[:, 0])
        previous = torch.tensor([self.code0_history], device=logits.device) if self.code0_history else None
        code0 = int(choose(logits, sampling, generator, previous, self.suppress))
        self.code0_history.append(code0)
        return code0

    def residual_codes(self, code0: int, sampling: Sampling, generator) -> list[int]:
        """Codes 1..15 of the frame whose code 0 was just chosen: step g reads lm_head[g-1]'s logits and feeds the
        code back through codec_embedding[g-1]."""
        predictor = self.talker.code_predictor
        cache = self.predictor_cache
        cache.crop(0)
        first = self.talker.get_input_embeddings()(torch.tensor([[code0]], device=self.last_hidden.device))
        embeds = torch.cat((self.last_hidden, first), dim=1)
        codes = []
        for group in range(self.config.num_code_groups - 1):
            hidden, _ = run_stack(predictor.model, embeds, cache, mrope=False)
            code = choose(predictor.lm_head[group](hidden[:, -1]), sampling, generator)
            codes.append(int(code))
            embeds = predictor.model.codec_embedding[group](code.view(1, 1))
        return codes

    def codec_embedding_sum(self, codes: list[int]) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of one frame [1, 1, hidden], the Talker's input for the next step."""
        device = self.last_hidden.device
        ids = torch.tensor(codes, device=device).view(-1, 1, 1)
        parts = [self.talker.get_input_embeddings()(ids[0])]
        parts += [emb(ids[g + 1]) for g, emb in enumerate(self.talker.code_predictor.model.codec_embedding)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True)

    def step(self, codes: list[int], text: torch.Tensor, sampling: Sampling, generator) -> int:
        """One Talker step: the last frame's codes plus one text position in, the next frame's code 0 out."""
        return self._forward(self.codec_embedding_sum(codes) + text, sampling, generator)
