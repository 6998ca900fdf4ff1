"""The event loop lateness and GC pause probes the server reports (rtc_agent.loop_lag)."""
from __future__ import annotations

import asyncio
import gc
import time

from rtc_agent.loop_lag import GcPauses, LoopLag
from rtc_support import run


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
