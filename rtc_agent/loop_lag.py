"""How late an asyncio event loop wakes up, and how long Python's cyclic garbage collector stops every thread.

Both matter in one process that runs many calls' media on one event loop beside a GPU worker thread: a loop that
wakes up late handles caller audio late (the turn ends late) and sends answer packets late. The server reports
them per answer and in /metrics; the load tester watches its own loops with the same class.

`RTC_AGENT_STALL_MS=N` (a diagnosis, off by default) also logs, in every process that watches its loop, the loop
thread's stack each time the loop takes more than N ms to run a callback: what held it up.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

log = logging.getLogger(__name__)


class LoopLag:
    """Sleeps `period_s` again and again on the running loop and records how late each wake-up was (ms).

    `max_ms` is the largest lateness seen; `max_since(t)` the largest of the wake-ups after time.monotonic() `t`
    within the last `keep_s`. `on_sample(ms)` hears of each wake-up (a histogram)."""

    def __init__(self, period_s: float = 0.05, keep_s: float = 120.0,
                 on_sample: Callable[[float], None] | None = None) -> None:
        self.period_s, self.max_ms = period_s, 0.0
        self._on_sample = on_sample
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(keep_s / period_s))

    async def watch(self) -> None:
        stall_ms = float(os.environ.get("RTC_AGENT_STALL_MS") or 0)
        if stall_ms > 0:
            StallReporter(asyncio.get_running_loop(), stall_ms).start()
        while True:
            due = time.monotonic() + self.period_s
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            late_ms = max(0.0, (now - due) * 1000)
            self.max_ms = max(self.max_ms, late_ms)
            self._recent.append((now, late_ms))
            if self._on_sample is not None:
                self._on_sample(late_ms)

    def max_since(self, since: float) -> float | None:
        """The largest lateness of the wake-ups after `since` (None: none recorded since then)."""
        late = [ms for t, ms in self._recent if t > since]
        return round(max(late), 1) if late else None


class StallReporter:
    """A thread that posts a callback to `loop` every few milliseconds and, when one waits more than `threshold_ms`
    to run, logs the stack the loop's thread was in at that moment and how long the stall lasted. Build it on
    the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold_ms: float) -> None:
        self._loop, self._threshold_s = loop, threshold_ms / 1000
        self._loop_thread = threading.get_ident()

    def start(self) -> None:
        threading.Thread(target=self._run, name="stall-reporter", daemon=True).start()

    def _run(self) -> None:
        while not self._loop.is_closed():
            ran = threading.Event()
            posted = time.monotonic()
            try:
                self._loop.call_soon_threadsafe(ran.set)
            except RuntimeError:  # the loop closed
                return
            if ran.wait(self._threshold_s):
                time.sleep(0.005)
                continue
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame, limit=16)) if frame is not None else "?"
            ran.wait()
            log.warning("the event loop stalled %.0f ms; %.0f ms into it, it was in:\n%s",
                        (time.monotonic() - posted) * 1000, self._threshold_s * 1000, stack)


class GcPauses:
    """Reports each cyclic garbage collection's duration (ms) and generation to `on_pause` while installed. A
    collection holds the GIL: nothing else in the process runs, neither the event loop nor the engine's worker."""

    def __init__(self, on_pause: Callable[[int, float], None]) -> None:
        self._on_pause = on_pause
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._on_pause(info["generation"], (time.perf_counter() - self._started) * 1000)

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


LAG_BUCKETS_MS = (1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 5000)
_frozen = 0  # objects freeze_startup_objects took out of the collector's reach


def freeze_startup_objects() -> None:
    """Takes what start-up made (torch, transformers and, where loaded, the model: ~400 000 objects) out of the
    cyclic garbage collector's reach. A full collection over them holds the GIL for ~150 ms (tiny model, 2-core
    CPU) to ~225-320 ms (full size, the H200 machine), which stops every call's media and the engine's worker at
    once; they live as long as the process anyway."""
    global _frozen
    gc.collect()
    gc.freeze()
    if not _frozen:  # (once: the collection at exit then frees them, and nanobind's leak check stays quiet)
        atexit.register(gc.unfreeze)
    _frozen = gc.get_freeze_count()  # (it walks them all, 40 ms and more: counted once, here, not per scrape)


def watched_process(registry: Any) -> tuple[LoopLag, GcPauses]:
    """The metrics every server process shows (a prometheus_client registry of its own): its CPU and memory, how
    late its event loop wakes up, its garbage collections and the objects kept out of their reach (`gc.freeze`).
    Start `watch()`, `install()` the pauses."""
    from prometheus_client import Gauge, Histogram, ProcessCollector

    ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory
    lag = Histogram("rtc_agent_event_loop_lag_ms", "How late the event loop (every call's media and signaling, or "
                    "the engine's requests) woke up from a 50 ms sleep: high when the process's CPU is short",
                    buckets=LAG_BUCKETS_MS, registry=registry)
    pauses = Histogram("rtc_agent_gc_pause_ms", "Python's cyclic garbage collections, by generation: the whole "
                       "process waits for each", ["generation"], buckets=LAG_BUCKETS_MS, registry=registry)
    Gauge("rtc_agent_gc_frozen_objects", "Objects made at start-up (torch, transformers, the models) that the "
          "collector no longer walks: a full collection over them stops the process for 150-300 ms",
          registry=registry).set_function(lambda: _frozen)
    return (LoopLag(on_sample=lag.observe),
            GcPauses(lambda generation, ms: pauses.labels(str(generation)).observe(ms)))
