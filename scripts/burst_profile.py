"""A burst of turn ends on the engine alone: N sessions each take 2 s of caller-like audio, then all N prepare
their answers at once (`Session.prepare_answer`); prints how long each burst took, and with --stats a cProfile of
the engine's worker thread over the later bursts (where its host time goes between the GPU's stages).

    python3 scripts/burst_profile.py [--model synthetic:30b-a3b] [--sessions 24] [--bursts 6] [--stats]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from rtc_agent.engine.engine import Engine
from rtc_agent.engine.options import EngineOptions, SessionOptions


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


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:30b-a3b")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--stats", action="store_true", help="profile the worker thread in the later bursts")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine.load(EngineOptions(model=args.model, max_sessions=args.sessions, device=device))
    await engine.warmup()
    sessions = [engine.new_session(SessionOptions(max_answer_tokens=6, max_frames=3, seed=i))
                for i in range(args.sessions)]
    profile = cProfile.Profile()
    for burst in range(args.bursts):
        profiled = args.stats and burst >= args.bursts // 3  # (the first bursts warm up)
        await asyncio.gather(*(say(s, burst * 100 + i) for i, s in enumerate(sessions)))
        await asyncio.gather(*(s.flush() for s in sessions))
        if profiled:
            await engine.run(profile.enable)  # (enabled on the worker's thread)
        began = time.perf_counter()
        await asyncio.gather(*(s.prepare_answer() for s in sessions))
        took = (time.perf_counter() - began) * 1e3
        if profiled:
            await engine.run(profile.disable)
        print(f"burst {burst}: {args.sessions} preparations in {took:.1f} ms", flush=True)
        await asyncio.gather(*(listen(s) for s in sessions))
    for order in ("tottime", "cumulative") if args.stats else ():
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(30)
        print(out.getvalue(), flush=True)
    for session in sessions:
        await session.close()


if __name__ == "__main__":
    asyncio.run(main())
