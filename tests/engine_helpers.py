"""Shared pieces of the engine tests: the engine under test, caller audio, and running one turn."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from rtc_agent.engine import Engine, EngineOptions, ResponseDone, SessionOptions, SpeechFrame, TextDelta
from rtc_support import run  # noqa: F401  (a loop of its own: Playwright may hold the main thread's)

_engines: dict[EngineOptions, Engine] = {}


def engine_for(**options) -> Engine:
    """One loaded engine per set of options for the whole test run (loading takes seconds)."""
    # (more slots than a server's 4: tests drop sessions without closing them, and one held by a traceback's
    # frames keeps its slot until the cyclic GC frees it)
    key = EngineOptions(**{"max_sessions": 16, **options})
    if key not in _engines:
        _engines[key] = Engine.load(key)
    return _engines[key]


def caller_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like signal: a gliding harmonic tone under an amplitude envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    pitch = 120 + 40 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(pitch) / 16000
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    return (0.2 * voiced * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


async def one_turn(session, audio: np.ndarray, piece: int = 320, cancel_after: int | None = None,
                   frames_played: int | None = None):
    """Push `audio` in 20 ms pieces, then collect the answer's events."""
    for start in range(0, len(audio), piece):
        await session.push_audio(audio[start:start + piece])
    texts, frames, done = [], [], None
    async for event in session.respond():
        if isinstance(event, TextDelta):
            texts.append(event)
        elif isinstance(event, SpeechFrame):
            frames.append(event)
            if cancel_after is not None and len(frames) == cancel_after:
                await session.cancel(frames_played)
        else:
            assert isinstance(event, ResponseDone)
            done = event
    assert done is not None
    return texts, frames, done


def greedy(**kwargs) -> SessionOptions:
    return SessionOptions(greedy=True, seed=0, **kwargs)


@contextlib.contextmanager
def recording_stock_codes(model: Any) -> Iterator[dict[str, Any]]:
    """While open, what stock `generate` hands Code2Wav lands in the yielded dict under "codes" (the decode
    itself stays stock's)."""
    recorded: dict[str, Any] = {}
    original = model.code2wav.chunked_decode

    def recording_decode(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    model.code2wav.chunked_decode = recording_decode
    try:
        yield recorded
    finally:
        del model.code2wav.chunked_decode
