"""Caller video in: keep about 2 frames per second, small, for the model (which sees no more than that)."""
from __future__ import annotations

import time
from typing import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

FPS = 2.0
MAX_SIDE = 448


def downscale(width: int, height: int, max_side: int = MAX_SIDE) -> tuple[int, int]:
    """The size that fits in max_side x max_side, keeping the aspect ratio and even dimensions."""
    scale = min(1.0, max_side / max(width, height))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


async def sample_video(track: MediaStreamTrack, on_image: Callable[[np.ndarray], None], fps: float = FPS) -> None:
    """Reads every frame (aiortc queues what is not read) and hands on an RGB array `fps` times a second."""
    period, due = 1.0 / fps, 0.0
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        now = time.monotonic()
        if not isinstance(frame, av.VideoFrame) or now < due:
            continue
        due = due + period if now - due < period else now + period  # on a steady grid, no catch-up bursts
        width, height = downscale(frame.width, frame.height)
        on_image(frame.to_ndarray(width=width, height=height, format="rgb24"))
