"""A microphone for aiortc clients: plays whatever audio it is given, in real time, as 20 ms frames; silence
in between. `call` gives it a WAV, `talk` the sound card's input, tests espeak-ng speech."""
from __future__ import annotations

import asyncio
import fractions
import time

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

RATE = 48_000
FRAME = 960  # 20 ms
TIME_BASE = fractions.Fraction(1, RATE)


def load_audio(path: str, rate: int = RATE) -> np.ndarray:
    """Any audio file (WAV, ...) -> mono float32 at `rate`."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts = []
    with av.open(path) as container:
        for frame in container.decode(audio=0):
            frame.pts = None
            parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def speech_spans(samples: np.ndarray, rate: int = RATE, min_gap_s: float = 1.0, level_db: float = -40.0
                 ) -> list[tuple[int, int]]:
    """(start, end) sample indices of the utterances in a recording: loud 20 ms windows, split at gaps of
    at least `min_gap_s`. A WAV for `call` is utterances with pauses long enough for an answer."""
    win = rate // 50
    n = len(samples) // win
    if n == 0:
        return []
    rms = np.sqrt(np.mean(samples[: n * win].reshape(n, win) ** 2, axis=1) + 1e-12)
    loud = np.nonzero(20 * np.log10(rms) > level_db)[0]
    spans: list[tuple[int, int]] = []
    for w in map(int, loud):
        if spans and (w * win - spans[-1][1]) < min_gap_s * rate:
            spans[-1] = (spans[-1][0], (w + 1) * win)
        else:
            spans.append((w * win, (w + 1) * win))
    return spans


class Microphone(MediaStreamTrack):
    """An audio track that sends queued samples (48 kHz mono) in real time, and silence when there are none."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue = np.zeros(0, np.float32)
        self._sent = 0  # samples handed to aiortc so far
        self.started_at: float | None = None  # time.monotonic() of sample 0

    def play(self, samples: np.ndarray) -> int:
        """Queues mono float32 samples at 48 kHz; returns the stream index at which they start."""
        start = self._sent + len(self._queue)
        self._queue = np.concatenate([self._queue, np.asarray(samples, np.float32)])
        return start

    @property
    def idle(self) -> bool:
        return len(self._queue) == 0

    def time_at(self, index: int) -> float:
        """When sample `index` of the stream goes out (time.monotonic())."""
        if self.started_at is None:
            raise RuntimeError("the microphone has not started")
        return self.started_at + index / RATE

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self.started_at is None:
            self.started_at = time.monotonic()
        delay = self.time_at(self._sent) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        chunk = np.zeros(FRAME, np.float32)
        take = min(FRAME, len(self._queue))
        chunk[:take] = self._queue[:take]
        self._queue = self._queue[take:]
        pcm = (np.clip(chunk, -1.0, 1.0) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.pts = self._sent
        frame.time_base = TIME_BASE
        self._sent += FRAME
        return frame
