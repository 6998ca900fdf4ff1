"""One stage of the worker's round: every request of one kind (policy.py's five) in one batched pass."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..step.answer import speak
from .policy import AudioRequest, FrameRequest, PrefillRequest, Request, TalkerPrefillRequest, TokenRequest
from .slots import SlotPool


class StageRunner:
    """Runs a stage's requests, results in order: every stretch of audio in one pass of the audio encoder
    (`encode_audio`), or every Thinker prefill in one batched step, or every answer's first token in one draw, or
    every Talker prefill in one batched step, or every prepared answer's first frame in one batched step (each
    session has at most one request in a stage; the worker runs them in `REQUEST_STAGES` order)."""

    def __init__(self, pool: SlotPool, encode_audio: Callable[[list[np.ndarray]], list[torch.Tensor]]) -> None:
        self.pool = pool
        self.encode_audio = encode_audio
        self.kinds: list[tuple[type, Callable[[list[Any]], list[Any]]]] = [
            (AudioRequest, self._encode), (PrefillRequest, pool.prefill), (TokenRequest, pool.first_tokens)]
        if pool.talker is not None:
            self.kinds += [(TalkerPrefillRequest, pool.talker.prefill), (FrameRequest, self._first_frames)]

    def __call__(self, requests: list[Request]) -> list[Any]:
        results: list[Any] = [None] * len(requests)
        for kind, run in self.kinds:
            index = [i for i, r in enumerate(requests) if isinstance(r, kind)]
            if index:
                for i, result in zip(index, run([requests[i] for i in index])):
                    results[i] = result
        return results

    def _encode(self, requests: list[AudioRequest]) -> list[torch.Tensor]:
        return self.encode_audio([r.samples for r in requests])

    def _first_frames(self, requests: list[FrameRequest]) -> list[None]:
        speak(self.pool, [r.answer for r in requests], first=True)
        return [None] * len(requests)
