"""The memory guard: GPU memory in the gauges, and what the server does when it runs short.

Every `POLL_S` (and at every offer and every /metrics scrape) the guard reads the GPU's memory through one small
function, the engine's `memory()` (a test may hand the server another reader that reports a chosen fill level).
Above `--memory-guard-pct` of the memory this process may use:

- new calls are refused: 503 `server_full` with `reason: "memory"` and Retry-After (and /capacity says full);
- the calls that send video get a shorter video window (halved every `SHORTEN_EVERY_S` while memory stays high,
  down to `MIN_VIDEO_WINDOW_S`): the prefills and cache rebuilds of a long video context are what grows most.

Below it again, calls are admitted again; windows already shortened stay so for the rest of their calls.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from .metrics import Metrics

log = logging.getLogger(__name__)
POLL_S = 0.5
SHORTEN_EVERY_S = 5.0  # time for a shortened window to take effect (its next second of video) before the next cut
MIN_VIDEO_WINDOW_S = 4


class MemoryGuard:
    def __init__(self, read: Callable[[], Any], limit_pct: float, video_window_s: int, metrics: Metrics) -> None:
        self._read = read  # () -> engine MemoryUse, or None (no GPU, or no engine yet)
        self.limit_pct = limit_pct
        self.metrics = metrics
        self.over = False
        self.last: Any = None  # the latest reading
        self._full_window_s = video_window_s
        self._window_s = video_window_s  # the window the next cut gives calls with video
        self._shortened_at = -float("inf")

    def check(self) -> Any:
        """Read the memory now: updates the gauges and `over`; returns the reading (None without a GPU)."""
        use = self._read()
        self.last = use
        self.metrics.show_memory(use)
        over = use is not None and self.limit_pct < 100 and use.used_pct > self.limit_pct
        if over != self.over:
            if over:
                log.warning("memory guard: %s, above %g %%: no new calls; calls with video get shorter windows",
                            describe(use), self.limit_pct)
            else:
                log.info("memory guard: %s, below %g %% again: new calls are admitted", describe(use),
                         self.limit_pct)
                self._window_s = self._full_window_s
        self.over = over
        self.metrics.memory_guard.set(1 if over else 0)
        return use

    def refusal(self) -> str | None:
        """Why a new call cannot be admitted now (memory above the guard), or None."""
        use = self.check()
        if not self.over:
            return None
        return f"GPU memory is {describe(use)}, above this server's {self.limit_pct:g} % guard"

    async def run(self, calls: Callable[[], Iterable[Any]]) -> None:
        """Watch the memory for as long as the server serves; `calls()`: the calls in progress."""
        while True:
            try:
                self.check()
                now = time.monotonic()
                if self.over and now - self._shortened_at >= SHORTEN_EVERY_S:
                    self._shortened_at = now
                    await self._shorten_video(list(calls()))
            except Exception:  # a failed reading must not stop the watch (logging is rate-limited)
                log.exception("memory guard: reading the GPU memory failed")
            await asyncio.sleep(POLL_S)

    async def _shorten_video(self, calls: list[Any]) -> None:
        self._window_s = max(MIN_VIDEO_WINDOW_S, self._window_s // 2)
        windows = []
        for call in calls:
            try:
                window = await call.conversation.session.limit_video(self._window_s)
            except RuntimeError:  # the call ended meanwhile (its session is closed)
                continue
            if window is not None:
                windows.append(window)
        if windows:
            log.warning("memory guard: video windows of %d call(s) now %s s", len(windows),
                        ", ".join(str(w) for w in windows))


def describe(use: Any) -> str:
    return f"{use.used_pct:.1f} % used ({use.used_bytes / 1e9:.1f} of {use.total_bytes / 1e9:.1f} GB)"
