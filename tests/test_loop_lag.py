"""The event loop lateness and GC pause probes the server reports (rtc_agent.loop_lag)."""
from __future__ import annotations

import asyncio
import gc
import logging
import time

from rtc_agent.loop_lag import GcPauses, LoopLag
from rtc_support import run


def _holds_the_loop() -> None:
    time.sleep(0.3)


def test_the_stall_diagnosis_logs_what_held_the_loop(monkeypatch, caplog) -> None:
    """RTC_AGENT_STALL_MS: a stall longer than it is logged with the loop thread's stack at the time."""
    monkeypatch.setenv("RTC_AGENT_STALL_MS", "30")

    async def main_() -> None:
        watcher = asyncio.ensure_future(LoopLag(period_s=0.01).watch())
        await asyncio.sleep(0.1)
        _holds_the_loop()
        await asyncio.sleep(0.1)
        watcher.cancel()

    with caplog.at_level(logging.WARNING, logger="rtc_agent.loop_lag"):
        run(main_())
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert any("_holds_the_loop" in stall for stall in stalls), stalls  # (a busy machine may add short ones)


def test_a_blocked_loop_shows_as_lateness_after_the_time_it_began() -> None:
    samples: list[float] = []

    async def main_() -> tuple[float, float | None, float | None]:
        lag = LoopLag(period_s=0.01, on_sample=samples.append)
        watcher = asyncio.ensure_future(lag.watch())
        await asyncio.sleep(0.05)
        before = time.monotonic()
        time.sleep(0.3)  # a callback that holds the loop
        await asyncio.sleep(0.05)
        watcher.cancel()
        return before, lag.max_since(before), lag.max_since(time.monotonic() + 1)

    before, since_block, since_future = run(main_())
    assert since_block is not None and since_block >= 250
    assert since_future is None  # nothing recorded after that time
    assert max(samples) >= 250 and len(samples) >= 2  # every wake-up reported


def test_gc_pauses_report_each_collection_while_installed() -> None:
    pauses: list[tuple[int, float]] = []
    probe = GcPauses(lambda generation, ms: pauses.append((generation, ms)))
    probe.install()
    try:
        gc.collect()
    finally:
        probe.uninstall()
    assert (2, pauses[-1][1]) == pauses[-1] and pauses[-1][1] >= 0
    count = len(pauses)
    gc.collect()
    assert len(pauses) == count  # uninstalled: no more reports
