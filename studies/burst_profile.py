"""A burst of turn ends on the engine alone: N sessions each take 2 s of caller-like audio, then all N prepare
their answers at once (`Session.prepare_answer`); prints how long each burst took, and with --stats a cProfile of
the engine's worker thread over the later bursts (where its host time goes between the GPU's stages).

    python3 -m studies.burst_profile [--model synthetic:30b-a3b] [--sessions 24] [--bursts 6] [--stats]
        [--verdicts 16] [--slow-calls 4]

--verdicts V: in the later half of the bursts, V Smart Turn verdicts are asked of the engine's scorer at the same
moment as the preparations (what the server's default `overflow` does when callers stop together; needs a GPU and
the Smart Turn file). --slow-calls MS: every call into C (a torch op, a wait) that took over MS ms on the worker's
thread in the later bursts, with where it was made (on Python 3.12 and later on every thread, the scorer's too).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import threading
import time

import numpy as np
import torch

from rtc_agent.engine.options import EngineOptions, SessionOptions
from rtc_agent.engine.session.engine import Engine


def caller_audio(seconds: float, seed: int) -> np.ndarray:
    """A gliding harmonic tone with noise: speech-like for the VAD-free engine, different per seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    phase = 2 * np.pi * np.cumsum(120 + 40 * np.sin(2 * np.pi * 0.7 * t + seed)) / 16000
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    return (0.2 * voiced + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


async def say(session, seed: int) -> None:
    audio = caller_audio(2.0, seed)
    for start in range(0, len(audio), 512):  # 32 ms chunks, as a media process pushes them
        await session.push_audio(audio[start:start + 512])


async def listen(session) -> None:
    async for _ in session.respond():
        pass


class SlowCalls:
    """A profile hook that keeps every C call over `limit_ms`: (thread, function, where it was called) -> times."""

    def __init__(self, limit_ms: float) -> None:
        self.limit = limit_ms / 1e3
        self.calls: dict[tuple[str, str, str], list[float]] = {}
        self._started: dict[int, float] = {}

    def hook(self, frame, event: str, arg) -> None:
        if event == "c_call":
            self._started[id(frame)] = time.perf_counter()
        elif event in ("c_return", "c_exception") and (began := self._started.pop(id(frame), None)) is not None:
            took = time.perf_counter() - began
            if took > self.limit:
                where = " < ".join(f"{f.f_code.co_filename.split('/')[-1]}:{f.f_lineno}"
                                   for f in _outer(frame, 4))
                key = (threading.current_thread().name, getattr(arg, "__qualname__", repr(arg)), where)
                self.calls.setdefault(key, []).append(took * 1e3)

    def report(self) -> None:
        for (thread, name, where), times in sorted(self.calls.items(), key=lambda item: -sum(item[1])):
            print(f"{thread}: {name} x{len(times)}, ms {', '.join(f'{t:.1f}' for t in sorted(times)[-6:])}\n"
                  f"    at {where}", flush=True)


def _outer(frame, count: int):
    while frame is not None and count:
        yield frame
        frame, count = frame.f_back, count - 1


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:30b-a3b")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--stats", action="store_true", help="profile the worker thread in the later bursts")
    parser.add_argument("--verdicts", type=int, default=0, help="Smart Turn verdicts asked with the later bursts")
    parser.add_argument("--slow-calls", type=float, metavar="MS", help="C calls over MS ms in the later bursts")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine.load(EngineOptions(model=args.model, max_sessions=args.sessions, device=device))
    await engine.warmup()
    if args.verdicts and engine.turn_scoring is None:
        sys.exit("--verdicts: this engine does not score turns (it needs a GPU and Smart Turn's file)")
    turns = [caller_audio(3.0, 1000 + i) for i in range(args.verdicts)]
    slow = SlowCalls(args.slow_calls) if args.slow_calls else None
    sessions = [engine.new_session(SessionOptions(max_answer_tokens=6, max_frames=3, seed=i))
                for i in range(args.sessions)]
    profile = cProfile.Profile()
    for burst in range(args.bursts):
        profiled = args.stats and burst >= args.bursts // 3  # (the first bursts warm up)
        later = burst >= args.bursts // 2
        await asyncio.gather(*(say(s, burst * 100 + i) for i, s in enumerate(sessions)))
        await asyncio.gather(*(s.flush() for s in sessions))
        if profiled:
            await engine.run(profile.enable)  # (enabled on the worker's thread)
        if slow and later:
            await _set_profile(engine, slow.hook)
        began = time.perf_counter()
        verdicts = asyncio.gather(*(engine.score_turn(t) for t in turns)) if later and turns else None
        await asyncio.gather(*(s.prepare_answer() for s in sessions))
        took = (time.perf_counter() - began) * 1e3
        line = f"burst {burst}: {args.sessions} preparations in {took:.1f} ms"
        if verdicts is not None:
            await verdicts
            line += f"; {len(turns)} verdicts asked with them, back after {(time.perf_counter() - began) * 1e3:.1f} ms"
        if profiled:
            await engine.run(profile.disable)
        if slow and later:
            await _set_profile(engine, None)
        print(line, flush=True)
        await asyncio.gather(*(listen(s) for s in sessions))
    if slow:
        slow.report()
    for order in ("tottime", "cumulative") if args.stats else ():
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(30)
        print(out.getvalue(), flush=True)
    for session in sessions:
        await session.close()


async def _set_profile(engine, hook) -> None:
    """`hook` on every thread where Python can (3.12), else on the engine's worker thread."""
    if hasattr(threading, "setprofile_all_threads"):
        threading.setprofile_all_threads(hook)
    else:
        await engine.run(sys.setprofile, hook)


if __name__ == "__main__":
    asyncio.run(main())
