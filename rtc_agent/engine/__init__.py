"""The model side of rtc-agent: Qwen3-Omni's Thinker, Talker and Code2Wav, streamed (see session/engine.py).

One turn passes through its subpackages in this order: ipc/ (from the media process) -> session/ (the call) ->
scheduler/ (the worker's rounds) -> step/ (the batched work) -> model/ (the weights and kernels). events.py,
options.py and errors.py are the vocabulary that every side shares; bench.py measures the whole.

The names below load on first use (PEP 562): a media process imports `engine.events`, `engine.options` and
`engine.ipc.remote` without pulling in transformers and the model code, which took 6 s of CPU at each process start,
out of the cores that the calls' media and the engine share."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "TurnTooLongError": "errors", "PREPARE_AFTER_SILENCE_MS": "scheduler.policy", "Engine": "session.engine",
    "EngineFullError": "errors", "Session": "session.engine", "FRAME_SAMPLES": "events", "INPUT_SAMPLE_RATE": "events",
    "OUTPUT_SAMPLE_RATE": "events", "ResponseDone": "events", "SpeechFrame": "events", "TextDelta": "events",
    "ContextFullError": "model.kv_cache", "ModelLoadError": "model.loader", "EngineOutOfMemory": "model.memory",
    "MemoryUse": "model.memory",
    "VOICES": "options", "EngineOptions": "options", "SessionOptions": "options", "Sampling": "step.sampling",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
