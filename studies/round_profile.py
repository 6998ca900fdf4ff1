"""Where the GPU time of a turn-end round goes: the batched Thinker prefill [rows, 32] and Talker prefill, timed
for 1-24 sessions, one profiled, and the Thinker's MoE block alone at the token counts a round could have.

    python3 -m studies.round_profile [--model synthetic:30b-a3b] [--sessions 24] [--tokens 12]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from rtc_agent.engine.options import EngineOptions, SessionOptions
from rtc_agent.engine.scheduler.policy import PrefillRequest, TalkerPrefillRequest
from rtc_agent.engine.session.engine import Engine

ON_GPU = torch.cuda.is_available()
ACTIVITIES = [torch.profiler.ProfilerActivity.CUDA if ON_GPU else torch.profiler.ProfilerActivity.CPU]
SORT_BY = "cuda_time_total" if ON_GPU else "cpu_time_total"


def _sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def _ms(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        began = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - began) * 1e3)
    return round(sorted(times)[len(times) // 2], 2)


def _profile(engine: Engine, args) -> dict:
    pool, talker = engine.pool, engine.pool.talker
    hidden = engine.model.config.thinker_config.text_config.hidden_size
    talker_hidden = engine.model.config.talker_config.text_config.hidden_size
    slots = pool.slots[:args.sessions]
    for slot in slots:  # a system prompt's worth of context
        slot.cache.crop(0)
        slot.cache.begin(args.context)
        slot.cache.commit()
        slot.talker.cache.crop(0)
        slot.talker.cache.begin(args.context // 2)
        slot.talker.cache.commit()
    lengths = [(s.cache.length, s.talker.cache.length) for s in slots]
    embeds = torch.randn(1, args.tokens, hidden, device=engine.device, dtype=engine.dtype) * 0.02
    talker_embeds = torch.randn(1, args.tokens + 9, talker_hidden, device=engine.device, dtype=engine.dtype) * 0.02

    def restore() -> None:
        for slot, (thinker, talker_length) in zip(slots, lengths):
            slot.cache.crop(thinker)
            slot.talker.cache.crop(talker_length)

    def thinker(n: int):
        return lambda: (pool.prefill([PrefillRequest(s, embeds) for s in slots[:n]]), restore())

    def talker_prefill(n: int):
        return lambda: (talker.prefill([TalkerPrefillRequest(s.talker, talker_embeds) for s in slots[:n]]), restore())

    result: dict = {"tokens": args.tokens, "context": args.context}
    counts = sorted({1, 2, 4, 8, 16, args.sessions} & set(range(1, args.sessions + 1)))
    result["thinker_prefill_ms"] = {n: _ms(thinker(n)) for n in counts}
    result["talker_prefill_ms"] = {n: _ms(talker_prefill(n)) for n in counts}
    block = engine.model.thinker.model.language_model.layers[0].mlp
    layers = engine.model.config.thinker_config.text_config.num_hidden_layers
    result["thinker_moe_ms_x_layers"] = {
        n: round(_ms(lambda: block(torch.randn(1, n, hidden, device=engine.device, dtype=engine.dtype))) * layers, 1)
        for n in (12, 32, 96, 192, 288, 384, 768)}
    for run, rows in ((thinker(args.sessions), 8), (talker_prefill(args.sessions), 6)):
        with torch.profiler.profile(activities=ACTIVITIES) as prof:
            run()
            _sync()
        print(prof.key_averages().table(sort_by=SORT_BY, row_limit=rows), flush=True)
    return result


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:30b-a3b")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--quantize", default="none")
    args = parser.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, max_sessions=args.sessions, quantize=args.quantize))
    await engine.warmup()
    sessions = [engine.new_session(SessionOptions()) for _ in range(args.sessions)]
    print(json.dumps(await engine.run(_profile, engine, args)), flush=True)
    for session in sessions:
        await session.close()


if __name__ == "__main__":
    asyncio.run(main())
