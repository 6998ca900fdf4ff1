"""A synthetic camera for scripted calls and tests: a moving colour pattern at a steady frame rate."""
from __future__ import annotations

import asyncio
import fractions
import time

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

CLOCK_RATE = 90_000  # RTP video clock
PATTERN_SPEED = 120  # pixels per second: every frame differs from the one before


class SyntheticCamera(MediaStreamTrack):
    """Frames of width x height at `fps`, in real time. When nobody reads it for a while (the sender's track was
    replaced by None), it goes on from now, as a camera does: no burst of the frames it missed."""

    kind = "video"

    def __init__(self, width: int = 640, height: int = 480, fps: float = 15.0) -> None:
        super().__init__()
        self.width, self.height = width, height
        self._period = 1.0 / fps
        self._ramp = np.arange(width)[None, :] + np.arange(height)[:, None]
        self._start: float | None = None
        self._next = 0.0  # when the next frame is due (time.monotonic())

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None or now - self._next > self._period:
            self._next = now
            self._start = now if self._start is None else self._start
        else:
            await asyncio.sleep(self._next - now)
        t = self._next - self._start
        self._next += self._period
        frame = av.VideoFrame.from_ndarray(self._pattern(t), format="rgb24")
        frame.pts, frame.time_base = int(t * CLOCK_RATE), fractions.Fraction(1, CLOCK_RATE)
        return frame

    def _pattern(self, t: float) -> np.ndarray:
        shift = int(t * PATTERN_SPEED)
        image = np.empty((self.height, self.width, 3), np.uint8)
        image[..., 0] = (self._ramp + shift) % 256
        image[..., 1] = (2 * self._ramp - shift) % 256
        image[..., 2] = (shift // 2) % 256
        return image
