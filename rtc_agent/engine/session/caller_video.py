"""Caller video frames waiting for the Thinker, grouped into seconds of video.

The vision encoder reads a temporal patch of two frames; at the 2 fps a call sends, that is one second of video,
and a second starts at a whole number of seconds after the caller's turn began, where its time position lines up
with the audio token of the same moment. A second with one frame repeats it (as the library's processor pads an
odd frame count); one with more keeps the first and the middle one. A second that looks the same as the last one
kept (a still camera, an unchanging screen) is left out: it would cost tokens and say nothing new.
"""
from __future__ import annotations

import collections
import math

import numpy as np

from ..step import vision_input

Frame = tuple[float, np.ndarray]  # (media-clock time in seconds, RGB uint8 [H, W, 3] at a patch-aligned size)


class CallerVideo:
    def __init__(self, unit: int, window_s: int, still_threshold: float) -> None:
        self.unit = unit  # frame sides are made multiples of this (patch size x merge size)
        self.window_s = window_s  # seconds of video kept for the context
        self.still_threshold = still_threshold  # mean absolute pixel difference (0-255) below which a second is still
        self.frames: collections.deque[Frame] = collections.deque()
        self.received = 0
        self.last_at: float | None = None
        self._last_kept: np.ndarray | None = None  # the last frame of the last second kept, for still detection

    def add(self, image: np.ndarray, at: float) -> None:
        image = vision_input.patch_aligned(vision_input.check_image(image), self.unit)
        self.frames.append((at, image))
        self.received += 1
        self.last_at = at if self.last_at is None else max(self.last_at, at)
        while self.frames and self.frames[0][0] < self.last_at - self.window_s - 2:  # never needed again
            self.frames.popleft()

    def active_since(self, at: float) -> bool:
        """Whether a frame was seen at or after `at` (the camera or a screen share is on)."""
        return self.last_at is not None and self.last_at >= at

    def take(self, start_at: float, lo: float, hi: float) -> tuple[list[tuple[int, np.ndarray]], list[Frame]]:
        """Remove the frames of the seconds in [lo, hi) counted from `start_at` and return them grouped as
        (second, frames [2, H, W, 3]), still ones left out, plus the frames removed. Frames of earlier seconds are
        dropped; later ones stay."""
        taken: dict[int, list[np.ndarray]] = {}
        consumed, kept = [], collections.deque()
        for at, image in sorted(self.frames, key=lambda f: f[0]):
            second = math.floor(at - start_at + 1e-6)
            if second >= hi:
                kept.append((at, image))
                continue
            consumed.append((at, image))
            if second >= lo:
                taken.setdefault(second, []).append(image)
        self.frames = kept
        seconds = []
        for second in sorted(taken):
            pair = self._pair(taken[second])
            if not self._still(pair):
                seconds.append((second, pair))
                self._last_kept = pair[-1]
        return seconds, consumed

    def give_back(self, frames: list[Frame]) -> None:
        """Frames taken for a turn that was dropped: they wait for the next turn again."""
        self.frames = collections.deque(sorted([*frames, *self.frames], key=lambda f: f[0]))
        self._last_kept = None

    @staticmethod
    def _pair(images: list[np.ndarray]) -> np.ndarray:
        first, second = images[0], images[len(images) // 2]
        return np.stack([first, second if second.shape == first.shape else first])

    def _still(self, pair: np.ndarray) -> bool:
        last = self._last_kept
        if last is None or last.shape != pair[0].shape:
            return False
        change = max(float(np.abs(frame.astype(np.int16) - last).mean()) for frame in pair)
        return change < self.still_threshold
