"""Checks that the fast decode path (CUDA graphs, single-token MoE kernels, decode attention, fused RMSNorm) makes
the same greedy answer as the eager path (layers one by one, the library's MoE, attention and RMSNorm) on one
loaded model.

    python -m rtc_agent.engine.check_fast_path --model synthetic:30b-a3b --tokens 32 --frames 16

Prints one JSON object: the tokens and frames compared, where (if anywhere) the two paths first differ, and the
largest logit difference at the first Thinker step. bf16 rounding can turn near-ties the other way; a divergence is
reported with the step at which it happened rather than hidden.
"""
from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np

from .engine import Engine
from .events import ResponseDone, SpeechFrame
from .loader import load
from .options import EngineOptions, SessionOptions


async def _answer(engine: Engine, audio: np.ndarray, tokens: int, frames: int):
    session = engine.new_session(SessionOptions(greedy=True, seed=0, max_answer_tokens=tokens, max_frames=frames))
    await session.push_audio(audio)
    codes, done = [], None
    async for event in session.respond():
        if isinstance(event, SpeechFrame):
            codes.append(event.codes)
        elif isinstance(event, ResponseDone):
            done = event
    await session.close()
    return list(done.token_ids), codes


def _first_difference(a: list, b: list) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:30b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--eager-kernels", choices=("library", "fast"), default="library",
                        help="MoE, decode attention and RMSNorm of the eager reference (fast: compares graphs alone)")
    parser.add_argument("--fast-kernels", choices=("fast", "library"), default="fast",
                        help="MoE, decode attention and RMSNorm of the graphed run (library: compares graphs alone)")
    parser.add_argument("--no-overlap", action="store_true", help="graphed run without the Thinker's side stream")
    args = parser.parse_args()
    loaded = load(args.model, args.device)
    t = np.arange(32000) / 16000
    audio = (0.2 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)
    options = dict(model=args.model, prefill_chunk_s=0, max_answer_tokens=args.tokens, max_frames=args.frames)
    results = {}
    for name, graphs, kernels in (("eager", False, args.eager_kernels), ("graphs", True, args.fast_kernels)):
        fast = kernels == "fast"
        engine = Engine(loaded, EngineOptions(cuda_graphs=graphs, fast_moe=fast, fast_attention=fast, fast_norm=fast,
                                              overlap=not args.no_overlap, **options))
        results[name] = asyncio.run(_answer(engine, audio, args.tokens, args.frames))
    (eager_tokens, eager_codes), (fast_tokens, fast_codes) = results["eager"], results["graphs"]
    report = {
        "model": args.model, "tokens_compared": len(eager_tokens), "frames_compared": len(eager_codes),
        "first_token_difference": _first_difference(eager_tokens, fast_tokens),
        "first_frame_difference": _first_difference(eager_codes, fast_codes),
        "tokens_equal": eager_tokens == fast_tokens, "frames_equal": eager_codes == fast_codes,
        "kernels": {"eager": args.eager_kernels, "graphs": args.fast_kernels}, "overlap": not args.no_overlap,
    }
    frame = report["first_frame_difference"]
    if frame is not None and frame < min(len(eager_codes), len(fast_codes)):  # which codebooks part first
        report["codebooks_differing_there"] = [g for g, (a, b) in enumerate(zip(eager_codes[frame], fast_codes[frame]))
                                               if a != b]
        report["frames_equal_count"] = sum(a == b for a, b in zip(eager_codes, fast_codes))
    print(json.dumps(report))
    return 0 if report["tokens_equal"] and report["frames_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
