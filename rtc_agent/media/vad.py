"""Voice activity (silero-vad, 512-sample chunks at 16 kHz) and the turn detector built on it.

This is the only place where the media side touches torch, and only through silero-vad.
"""
from __future__ import annotations

import asyncio
import enum
import threading
import warnings
from typing import Any

import numpy as np

CHUNK_SAMPLES = 512  # what silero-vad takes at 16 kHz
CHUNK_MS = 32

_import_lock = threading.Lock()


def _silero() -> Any:
    """Imports silero_vad without letting it set torch's thread count to 1 for the whole process."""
    with _import_lock:
        import torch

        threads = torch.get_num_threads()
        try:
            import silero_vad
        finally:
            torch.set_num_threads(threads)
        return silero_vad


class SpeechProbability:
    """One caller's silero-vad model (it keeps state from chunk to chunk)."""

    def __init__(self) -> None:
        silero = _silero()
        import torch

        threads = torch.get_num_threads()
        try:
            with warnings.catch_warnings():  # its loader uses deprecated importlib and torch.jit calls
                warnings.simplefilter("ignore", DeprecationWarning)
                self._model = silero.load_silero_vad()
        finally:
            torch.set_num_threads(threads)
        self._torch = torch

    def reset(self) -> None:
        """Forgets the audio heard so far (silero keeps state between chunks): ready for another call."""
        self._model.reset_states()

    def __call__(self, chunk: np.ndarray) -> float:
        if chunk.shape != (CHUNK_SAMPLES,):
            raise ValueError(f"silero-vad takes {CHUNK_SAMPLES} samples, got shape {chunk.shape}")
        # Without the TorchScript executor's optimisation: it profiles a model's first calls and then compiles
        # an optimised graph, which took 85 ms on a 2-core CPU and stalled the event loop (every call's media) for
        # over 250 ms on the H200 machine, once for each new model. Unoptimised, a call costs 0.24 ms against
        # 0.20 (median, 2-core CPU) and the first one 3 ms. The setting is per thread.
        with self._torch.inference_mode(), self._torch.jit.optimized_execution(False):
            return float(self._model(self._torch.from_numpy(chunk), 16_000))


class VadPool:
    """silero models handed from one call to the next. Loading one per call costs a TorchScript load and leaves
    a graph of scripted modules that only Python's cyclic GC frees (thousands over a few hundred calls). The
    pool holds at most as many models as calls were ever up at once.

    The server loads one per call slot at start-up (`preload`): a TorchScript load holds the GIL for long
    stretches, and loading them as calls arrive held up the media of the calls already talking (a stack dump of
    the H200 server, 16 callers joining, caught its event loop 250 ms late while a load ran)."""

    def __init__(self) -> None:
        self._free: list[SpeechProbability] = []

    def preload(self, count: int) -> None:
        """Loads models until `count` are free (blocking: run it off the event loop)."""
        while len(self._free) < count:
            self._free.append(SpeechProbability())

    async def acquire(self) -> SpeechProbability:
        if self._free:
            return self._free.pop()
        return await asyncio.to_thread(SpeechProbability)

    def release(self, vad: SpeechProbability) -> None:
        vad.reset()
        self._free.append(vad)


class Signal(enum.Enum):
    ONSET = "onset"  # the first speech chunk: audio starts flowing to the engine
    CONFIRMED = "confirmed"  # speech lasted min_speech_ms: a real turn (speech_started)
    FALSE_START = "false_start"  # speech too short, then silence: drop it
    ENDED = "ended"  # end_silence_ms of silence after confirmed speech (speech_stopped)


class TurnDetector:
    """Speech probabilities in, turn signals out; one call per 32 ms chunk.

    Hysteresis as in silero's own get_speech_timestamps: speech at p >= threshold, silence once p drops below
    threshold - 0.15, and the silence clock, once running, is only reset by speech. Speech shorter than
    min_speech_ms is a false start after silence_ms of silence; confirmed speech ends after end_silence_ms
    (the same by default; semantic_vad sets it to its longest wait and usually ends the turn sooner itself).
    """

    def __init__(self, threshold: float, silence_ms: int, min_speech_ms: int, end_silence_ms: int | None = None
                 ) -> None:
        self.threshold = threshold
        self.silence_ms = silence_ms
        self.min_speech_ms = min_speech_ms
        self.end_silence_ms = silence_ms if end_silence_ms is None else end_silence_ms
        self.active = False  # between ONSET and FALSE_START/ENDED
        self.confirmed = False
        self.speech_ms = 0
        self.silence_run_ms = 0

    @property
    def neg_threshold(self) -> float:
        return max(self.threshold - 0.15, 0.01)

    def reset(self) -> None:
        self.active = self.confirmed = False
        self.speech_ms = self.silence_run_ms = 0

    def feed(self, p: float) -> Signal | None:
        if not self.active:
            if p < self.threshold:
                return None
            self.active, self.speech_ms, self.silence_run_ms = True, CHUNK_MS, 0
            return self._maybe_confirm() or Signal.ONSET
        if p >= self.threshold:
            self.silence_run_ms = 0
            self.speech_ms += CHUNK_MS
            return self._maybe_confirm()
        if p < self.neg_threshold or self.silence_run_ms > 0:
            self.silence_run_ms += CHUNK_MS
            if self.silence_run_ms >= (self.end_silence_ms if self.confirmed else self.silence_ms):
                signal = Signal.ENDED if self.confirmed else Signal.FALSE_START
                self.reset()
                return signal
        return None

    def _maybe_confirm(self) -> Signal | None:
        if not self.confirmed and self.speech_ms >= self.min_speech_ms:
            self.confirmed = True
            return Signal.CONFIRMED
        return None
