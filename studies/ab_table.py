#!/usr/bin/env python3
"""The loads of `studies/device_ab.sh` (or device_processes.sh part 1) as one markdown table, and each worker
trace's bursts: what a closing note and docs/performance.md report of an A/B through the server.

    python3 -m studies.ab_table /work/.device/5/new1.tar.gz /work/.device/5/old2.tar.gz [--bursts 14]

Each argument is a run's tar.gz (one per spec) or its unpacked folder. A row per load file (loadtest-<i>-<N>.json,
in load order): the turns answered, heard and the server's first packet P50 / P90 in ms, late frames, the turns'
end-of-turn waits (P50 / max), the clients' speech-end spread and the server's largest loop lag. With `--bursts N`
(default 14; 0: none) each trace.<pid> then goes through worker_trace.py's burst summary (the TRACE=1 runs).
"""
from __future__ import annotations

import argparse
import json
import re
import tarfile
import tempfile
from pathlib import Path

from studies import worker_trace


def run_folder(path: Path, scratch: Path) -> Path:
    """The folder of a run: `path` itself, or its tar.gz unpacked under `scratch`."""
    if path.is_dir():
        return path
    with tarfile.open(path) as archive:
        archive.extractall(scratch / path.name, filter="data")
    return next(p for p in (scratch / path.name).iterdir() if p.is_dir())


def load_order(path: Path) -> int:
    match = re.match(r"loadtest-(\d+)-", path.name)
    return int(match.group(1)) if match else 1 << 30


def row(run: str, path: Path) -> str:
    """One load's row."""
    o = json.loads(path.read_text())["overall"]
    def p(key: str) -> str:
        value = o.get(key) or {}
        return f"{value.get('p50')} / {value.get('p90')}"
    eot = o.get("end_of_turn_wait_ms") or {}
    return (f"| {run} | {path.stem} | {o['answered']}/{o['turns']} | {p('heard_ms')} | {p('server_ttfp_ms')} | "
            f"{o['frames_late']} | {eot.get('p50')} / {eot.get('max')} | {o.get('speech_end_spread_ms')} | "
            f"{o.get('server_loop_lag_ms_max')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--bursts", type=int, default=14, metavar="N")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folders = [run_folder(run, Path(scratch)) for run in args.runs]
        print("| run | load | turns answered | heard P50 / P90 | first packet P50 / P90 | late "
              "| turn end wait P50 / max | speech-end spread | loop lag max |")
        print("|---|---|---|---|---|---|---|---|---|")
        for folder in folders:
            for path in sorted(folder.glob("loadtest-*.json"), key=load_order):
                print(row(folder.name, path))
        for folder in folders if args.bursts else ():
            for trace in sorted(folder.glob("trace.*")):
                print(f"\n{folder.name} {trace.name}:")
                worker_trace.bursts([json.loads(line) for line in trace.open()], args.bursts)


if __name__ == "__main__":
    main()
