"""The Talker's text-side inputs, made from Thinker tokens: the special tts embeddings, codec_bos, the projection
of Thinker tokens, and each voice's answer prefix. Made once per engine; the round's first tokens (`SlotPool`)
and every answer's Talker steps (answer.py) read them."""
from __future__ import annotations

import torch

from ..model.token_ids import TokenIds
from .graphs import to_device


class TalkerInputs:
    def __init__(self, model, ids: TokenIds, device: torch.device) -> None:
        self.model = model
        self.ids = ids
        self.device = device
        special = torch.tensor([[ids.tts_bos, ids.tts_eos, ids.tts_pad]], device=device)
        bos, eos, pad = self.project_text(model.thinker.get_input_embeddings()(special)).chunk(3, dim=1)
        self.tts: dict[str, torch.Tensor] = {"bos": bos, "eos": eos, "pad": pad}  # each [1, 1, hidden]
        codec_bos = torch.tensor([[model.config.talker_config.codec_bos_id]], device=device)
        self.codec_bos = model.talker.get_input_embeddings()(codec_bos)  # [1, 1, hidden]
        self._answer_prefixes: dict[str, torch.Tensor] = {}  # voice -> `answer_prefix`

    def project_text(self, embeds: torch.Tensor) -> torch.Tensor:
        """Thinker token embeddings → the Talker's text input (`text_projection`)."""
        return self.model.talker.text_projection(embeds)

    def text_input(self, ids: list[list[int]]) -> torch.Tensor:
        """The Talker's text-side input for rows of Thinker tokens: text_projection of their embeddings
        [rows, T, hidden]."""
        lm = self.model.thinker.model.language_model
        return self.project_text(lm.embed_tokens(to_device(torch.tensor(ids), self.device)))

    def answer_prefix(self, voice: str) -> torch.Tensor:
        """The Talker's input at the first 8 positions of every spoken answer in `voice` [1, 8, hidden], made once
        per voice. Text side: the assistant header's 3 ids (through text_projection), 4 x tts_pad, tts_bos. Codec
        side: zeros under the header, then nothink, think_bos, think_eos, the speaker, codec_pad. The 9th position,
        the answer's first text token over codec_bos, comes with the token (`SlotPool.first_tokens`)."""
        if voice not in self._answer_prefixes:
            cfg, i = self.model.config.talker_config, self.ids
            text = torch.cat((self.text_input([[i.im_start, i.assistant, i.newline]]), self.tts["pad"].expand(1, 4, -1),
                              self.tts["bos"]), dim=1)
            codec_ids = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id,
                         cfg.speaker_id[voice], cfg.codec_pad_id]
            codec = self.model.talker.get_input_embeddings()(to_device(torch.tensor([codec_ids]), self.device))
            self._answer_prefixes[voice] = text + torch.cat((text.new_zeros(1, 3, text.shape[-1]), codec), dim=1)
        return self._answer_prefixes[voice]
