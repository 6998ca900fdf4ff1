"""Caller video in: keep `fps` frames a second, scaled for the model's vision encoder (docs/api.md, "Video")."""
from __future__ import annotations

import time
from typing import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from ..config import VISION_BLOCK


def model_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """The size a width x height frame is given to the model at: scaled down (never up) to fit in
    max_side x max_side keeping the aspect ratio, then each side rounded to the nearest multiple of VISION_BLOCK
    (at least one block), so that the engine has nothing left to resize. max_side is a multiple of VISION_BLOCK."""
    scale = min(1.0, max_side / max(width, height))

    def side(pixels: int) -> int:
        return max(1, int(pixels * scale / VISION_BLOCK + 0.5)) * VISION_BLOCK

    return side(width), side(height)


class FrameGrid:
    """Which arriving frames to keep for `fps` frames a second: the first frame from a quarter period before each
    tick of a steady grid on (so that a sender at just `fps`, whose frames jitter around the ticks, keeps them all).
    After a pause (video off, a stalled network) the grid starts again from the next frame: no catch-up burst."""

    def __init__(self, fps: float) -> None:
        self.period = 1.0 / fps
        self._due = float("-inf")

    def keep(self, now: float) -> bool:
        if now < self._due - self.period / 4:
            return False
        self._due = self._due + self.period if now - self._due < self.period else now + self.period
        return True


async def sample_video(track: MediaStreamTrack, on_image: Callable[[np.ndarray], None], fps: float, max_side: int,
                       on_frame: Callable[[], None] = lambda: None) -> None:
    """Reads every frame of `track` (aiortc queues what is not read; `on_frame` counts them) and hands `fps` of
    them a second to `on_image` as RGB uint8 [H, W, 3] at model_size. Returns when the track ends."""
    grid = FrameGrid(fps)
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if not isinstance(frame, av.VideoFrame):
            continue
        on_frame()
        if grid.keep(time.monotonic()):
            width, height = model_size(frame.width, frame.height, max_side)
            on_image(frame.to_ndarray(width=width, height=height, format="rgb24", interpolation="AREA"))
