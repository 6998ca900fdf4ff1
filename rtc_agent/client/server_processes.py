"""What each of the server's processes spent during a load test, read from its /metrics before and after: CPU as
a share of one core, how late its event loop woke up (from the `rtc_agent_event_loop_lag_ms` histogram), and its
longest garbage collection (`rtc_agent_gc_pause_ms`: a collection stops the whole process). A
server split into processes labels each series with its `process` (front, engine, m0, m1, ...); a server in one
process has no label, and shows as "server". This says which side is short: an engine process at 100 % of a core,
or media processes whose loops wake up late."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

LATE_MS = 20.0  # a loop that wakes up later than this delays every call's media on it


async def snapshot(url: str, verify_tls: bool = True) -> dict[str, dict[str, Any]]:
    """Per process: CPU seconds so far, and the cumulative bucket counts of the loop-lag and collection-pause
    histograms (the pauses summed over generations)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url.rstrip('/')}/metrics", ssl=None if verify_tls else False) as r:
            text = await r.text()
    processes: dict[str, dict[str, Any]] = defaultdict(lambda: {"cpu_s": 0.0, "lag_buckets": {}, "gc_buckets": {}})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            process = processes[sample.labels.get("process", "server")]
            if sample.name == "process_cpu_seconds_total":
                process["cpu_s"] = sample.value
            elif sample.name == "rtc_agent_event_loop_lag_ms_bucket":
                process["lag_buckets"][float(sample.labels["le"])] = sample.value
            elif sample.name == "rtc_agent_gc_pause_ms_bucket":
                le = float(sample.labels["le"])
                process["gc_buckets"][le] = process["gc_buckets"].get(le, 0.0) + sample.value
    return dict(processes)


def usage(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], wall_s: float
          ) -> dict[str, dict[str, Any]]:
    """Per process, over the run: CPU in % of one core, the loop's wake-ups, how many came over LATE_MS late, the
    bucket bound the latest one stayed under (its lateness is at most that many ms), and the same bound for its
    longest garbage collection (None: none ran)."""
    out = {}
    for name, now in after.items():
        then = before.get(name, {"cpu_s": 0.0, "lag_buckets": {}, "gc_buckets": {}})
        restarted = now["cpu_s"] < then["cpu_s"]  # a new process took this one's place: its counts start at 0
        if restarted:
            then = {"cpu_s": 0.0, "lag_buckets": {}, "gc_buckets": {}}
        lag = _during(then["lag_buckets"], now["lag_buckets"])
        total = lag.get(math.inf, 0.0)
        on_time = max((n for le, n in lag.items() if le <= LATE_MS), default=0.0)
        out[name] = {"cpu_pct": round(100 * (now["cpu_s"] - then["cpu_s"]) / wall_s, 1) if wall_s > 0 else None,
                     "loop_wakeups": int(total), f"loop_late_over_{LATE_MS:g}_ms": int(total - on_time),
                     "loop_lag_ms_at_most": _at_most(lag),
                     "gc_pause_ms_at_most": _at_most(_during(then["gc_buckets"], now["gc_buckets"])),
                     **({"restarted": True} if restarted else {})}
    return out


def _during(then: dict[float, float], now: dict[float, float]) -> dict[float, float]:
    """A histogram's cumulative bucket counts over the run, by bucket bound."""
    return {le: n - then.get(le, 0.0) for le, n in sorted(now.items())}


def _at_most(counts: dict[float, float]) -> float | None:
    """The least bucket bound every sample of the run stayed under (None: no sample)."""
    total = counts.get(math.inf, 0.0)
    return next((le for le, n in counts.items() if n >= total), None) if total else None
