"""The special token ids the engine builds its inputs from, read once from the model's config and tokenizer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenIds:
    im_start: int
    im_end: int
    user: int
    assistant: int
    system: int
    newline: int
    audio: int
    audio_start: int
    audio_end: int
    vision_start: int
    vision_end: int
    video: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    multimodal: tuple[int, ...]

    @classmethod
    def from_model(cls, model, tokenizer) -> "TokenIds":
        c, t = model.config, model.config.thinker_config
        newline = tokenizer.encode("\n", add_special_tokens=False)
        if len(newline) != 1:
            raise ValueError(f"the tokenizer encodes a newline as {newline}, expected one token")
        return cls(c.im_start_token_id, c.im_end_token_id, c.user_token_id, c.assistant_token_id, c.system_token_id,
                   newline[0], t.audio_token_id, t.audio_start_token_id, t.audio_end_token_id,
                   t.vision_start_token_id, t.vision_end_token_id, t.video_token_id, c.tts_pad_token_id,
                   c.tts_bos_token_id, c.tts_eos_token_id, (t.audio_token_id, t.image_token_id, t.video_token_id))
