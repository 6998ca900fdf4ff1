#!/usr/bin/env python3
"""Read an engine worker trace (`RTC_AGENT_WORKER_TRACE=path rtc-agent serve ...` writes `path.<pid>`): where each
answer's preparation and start waited, and the worker's rounds and steps around them.

    python3 scripts/worker_trace.py trace.1234                  # every preparation and answer start: wait, run
    python3 scripts/worker_trace.py trace.1234 --around 2 --ms 800   # the timeline around the 2nd answer start
    python3 scripts/worker_trace.py trace.1234 --host               # the worker's time in each piece of each job

Times are ms; `wait` is from the job's submission to its start, `run` from its start to its end (rounds and steps
of other work in between included). A round lists its sessions' requests (AudioRequest, PrefillRequest,
TalkerPrefillRequest); a step, how many answers it advanced and the smallest lead among them before it; on a GPU
both say how long the GPU took for them (a round's own time is only the time to queue its work). `--host` sums
the `host` lines: the worker's time in each piece of a job (from its start or a round's result up to its next
request, or its end), by job and request; a piece that reads a GPU result back includes the wait for it.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

WATCHED = ("prepare_answer", "start")  # the jobs a waiting caller's first packet depends on


def jobs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job with its submission, start and end (a session's jobs start and end in order)."""
    open_: dict[Any, list[dict[str, Any]]] = {}
    done = []
    for e in events:
        queue = open_.setdefault(e.get("key"), [])
        if e["e"] == "submit":
            queue.append({"key": e["key"], "name": e["name"], "urgent": e["p"] == 0, "submit": e["t"]})
        elif e["e"] == "start":
            job = next((j for j in queue if "start" not in j and j["name"] == e["name"]), None)
            if job is not None:
                job["start"] = e["t"]
        elif e["e"] == "done":
            job = next((j for j in queue if "start" in j), None)
            if job is not None:
                job["done"] = e["t"]
                queue.remove(job)
                done.append(job)
    return sorted(done, key=lambda j: j["submit"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--around", type=int, help="print the timeline around the Nth answer start (1: the first)")
    p.add_argument("--ms", type=float, default=600, help="how far before and after it")
    p.add_argument("--host", action="store_true", help="the worker's time per piece of job, by job and request")
    args = p.parse_args()
    events = [json.loads(line) for line in open(args.trace)]
    if args.host:
        pieces: dict[tuple[str, str], list[float]] = {}
        for e in events:
            if e["e"] == "host":
                pieces.setdefault((e["name"], e["until"]), []).append(e["ms"])
        for (name, until), times in sorted(pieces.items(), key=lambda item: -sum(item[1])):
            times.sort()
            print(f"{name:<15} until {until:<22} n {len(times):5}  p50 {times[len(times) // 2]:6.2f}  "
                  f"p90 {times[int(len(times) * 0.9)]:6.2f}  max {times[-1]:7.2f}  sum {sum(times):8.1f} ms")
        return
    if args.around is None:
        for j in jobs(events):
            if j["name"] in WATCHED:
                print(f"session {j['key']:>3} {j['name']:<15} wait {j['start'] - j['submit']:6.1f}  "
                      f"run {j['done'] - j['start']:6.1f}")
        return
    starts = [e["t"] for e in events if e["e"] == "submit" and e["name"] == "start"]
    t0 = starts[args.around - 1]
    gpu = {e["n"]: e["ms"] for e in events if e["e"] == "gpu"}  # GPU time of each round and step, on a GPU
    for e in events:
        if abs(e["t"] - t0) > args.ms:
            continue
        at = f"{e['t'] - t0:8.1f}"
        on_gpu = f"  (GPU {gpu[e['n']]:.1f} ms)" if e.get("n") in gpu else ""
        if e["e"] == "round":
            kinds = ",".join(sorted({k.replace("Request", "") for k in e["kinds"]}))
            print(at, f"round {e['ms']:6.1f} ms  {len(e['keys'])} sessions  {kinds}{on_gpu}")
        elif e["e"] == "step":
            print(at, f"step  {e['ms']:6.1f} ms  {e['answers']} answers, least lead {e['lead_ms']} ms{on_gpu}")
        elif e["e"] in ("submit", "start") and (e["name"] in WATCHED or e["p"] == 0):
            print(at, f"{e['e']:<6} {e['name']} (session {e['key']}{', urgent' if e['p'] == 0 else ''})")


if __name__ == "__main__":
    main()
