#!/usr/bin/env python3
"""Read an engine worker trace (`RTC_AGENT_WORKER_TRACE=path rtc-agent serve ...` writes `path.<pid>`): where each
answer's preparation and start waited, and the worker's rounds and steps around them.

    python3 -m studies.worker_trace trace.1234                  # every preparation and answer start: wait, run
    python3 -m studies.worker_trace trace.1234 --around 2 --ms 800   # the timeline around the 2nd answer start
    python3 -m studies.worker_trace trace.1234 --host               # the worker's time in each piece of each job
    python3 -m studies.worker_trace trace.1234 --bursts 8           # each burst of 8 or more preparations: its rounds

Times are ms; `wait` is from the job's submission to its start, `run` from its start to its end (rounds and steps
of other work in between included). A round lists its sessions' requests (AudioRequest, PrefillRequest,
TalkerPrefillRequest); a step, how many answers it advanced and the smallest lead among them before it; on a GPU
both say how long the GPU took for them (a round's own time is only the time to queue its work). `--host` sums
the `host` lines: the worker's time in each piece of a job (from its start or a round's result up to its next
request, or its end), by job and request; a piece that reads a GPU result back includes the wait for it.
`--bursts N`: for each burst of at least N preparations asked for less than 100 ms after the one before
(callers who stop talking together), how long after the first ask the last first frames were made, and every
round up to then with its GPU time: whether the burst waited for the GPU or for the rounds' order.
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


def gpu_times(events: list[dict[str, Any]]) -> dict[int, float]:
    """The GPU time of each round and step (by its `n`), on a GPU."""
    return {e["n"]: e["ms"] for e in events if e["e"] == "gpu"}


def kinds(round_: dict[str, Any]) -> str:
    """A round's kinds of request, short: "Audio,Prefill"."""
    return ",".join(sorted({k.replace("Request", "") for k in round_["kinds"]}))


def bursts(events: list[dict[str, Any]], least: int) -> None:
    """Print each burst of at least `least` preparations: its asks' spread, its rounds up to its last first-frame
    stage, and their GPU time."""
    asks = [e["t"] for e in events if e["e"] == "submit" and e["name"] == "prepare_answer"]
    groups: list[list[float]] = []
    for t in asks:
        if groups and t - groups[-1][-1] < 100:
            groups[-1].append(t)
        else:
            groups.append([t])
    gpu = gpu_times(events)
    for group in (g for g in groups if len(g) >= least):
        t0 = group[0]
        rounds = [e for e in events if e["e"] == "round" and t0 <= e["t"] <= group[-1] + 1000]
        framed = [e["t"] for e in rounds if "FrameRequest" in e["kinds"]]
        end = max(framed) if framed else max((e["t"] for e in rounds), default=t0)
        rounds = [e for e in rounds if e["t"] <= end]
        on_gpu = sum(gpu.get(e["n"], 0.0) for e in rounds)
        print(f"{len(group)} preparations asked over {group[-1] - t0:.1f} ms; first frames made {end - t0:.1f} ms "
              f"after the first ask; {len(rounds)} rounds, {on_gpu:.1f} ms of GPU")
        for e in rounds:
            took = f"  GPU {gpu[e['n']]:6.1f} ms" if e["n"] in gpu else ""
            print(f"  {e['t'] - t0:7.1f}  round of {len(e['keys']):2} {kinds(e):<14} queued in {e['ms']:6.1f} ms{took}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--around", type=int, help="print the timeline around the Nth answer start (1: the first)")
    p.add_argument("--ms", type=float, default=600, help="how far before and after it")
    p.add_argument("--host", action="store_true", help="the worker's time per piece of job, by job and request")
    p.add_argument("--bursts", type=int, metavar="N", help="each burst of N or more preparations and its rounds")
    args = p.parse_args()
    events = [json.loads(line) for line in open(args.trace)]
    if args.bursts:
        bursts(events, args.bursts)
        return
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
    gpu = gpu_times(events)
    for e in events:
        if abs(e["t"] - t0) > args.ms:
            continue
        at = f"{e['t'] - t0:8.1f}"
        on_gpu = f"  (GPU {gpu[e['n']]:.1f} ms)" if e.get("n") in gpu else ""
        if e["e"] == "round":
            print(at, f"round {e['ms']:6.1f} ms  {len(e['keys'])} sessions  {kinds(e)}{on_gpu}")
        elif e["e"] == "step":
            print(at, f"step  {e['ms']:6.1f} ms  {e['answers']} answers, least lead {e['lead_ms']} ms{on_gpu}")
        elif e["e"] in ("submit", "start") and (e["name"] in WATCHED or e["p"] == 0):
            print(at, f"{e['e']:<6} {e['name']} (session {e['key']}{', urgent' if e['p'] == 0 else ''})")


if __name__ == "__main__":
    main()
