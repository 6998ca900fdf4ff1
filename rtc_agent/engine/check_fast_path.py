"""Checks that the fast decode path (CUDA graphs, single-token MoE kernels, decode attention, fused RMSNorm and rotary) makes
the same greedy answer as the eager path (layers one by one, the library's MoE, attention and RMSNorm) on one
loaded model.

    python -m rtc_agent.engine.check_fast_path --model synthetic:30b-a3b --tokens 32 --frames 16

Prints one JSON object: the tokens and frames compared, where (if anywhere) the two paths first differ, and the
eager run's top-1 − top-2 logit gap where the first frame parts, against one bf16 step at that logit: bf16 rounding
can turn near-ties the other way, and a divergence is reported with its margin rather than hidden.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math

import numpy as np

from . import talker as talker_module
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


@contextlib.contextmanager
def _recording_margins(margins: list):
    """Record the top-1 and top-2 logits of every Talker and code-predictor choice (eager runs only: a graphed
    predictor chooses inside its graph). Code-0 choices are recorded as None: their scores are penalised and
    suppressed before the choice, so the raw gap is not the deciding one."""
    original = talker_module.choose

    def choose(logits, sampling, *args, **kwargs):
        if args or "suppress" in kwargs or "seen" in kwargs:
            margins.append(None)
        else:
            top = logits.float().topk(2, dim=-1).values[0]
            margins.append((float(top[0]), float(top[1])))
        return original(logits, sampling, *args, **kwargs)

    talker_module.choose = choose
    try:
        yield
    finally:
        talker_module.choose = original


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
                        help="MoE, decode attention, RMSNorm and rotary of the eager reference (fast: compares graphs alone)")
    parser.add_argument("--fast-kernels", choices=("fast", "library"), default="fast",
                        help="MoE, decode attention, RMSNorm and rotary of the graphed run (library: compares graphs alone)")
    parser.add_argument("--no-overlap", action="store_true", help="graphed run without the Thinker's side stream")
    args = parser.parse_args()
    loaded = load(args.model, args.device)
    t = np.arange(32000) / 16000
    audio = (0.2 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)
    options = dict(model=args.model, prefill_chunk_s=0, max_answer_tokens=args.tokens, max_frames=args.frames)
    results, margins = {}, []
    for name, graphs, kernels in (("eager", False, args.eager_kernels), ("graphs", True, args.fast_kernels)):
        fast = kernels == "fast"
        engine = Engine(loaded, EngineOptions(cuda_graphs=graphs, fast_moe=fast, fast_attention=fast, fast_norm=fast,
                                              fast_rotary=fast, overlap=not args.no_overlap, **options))
        with _recording_margins(margins) if not graphs else contextlib.nullcontext():
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
        codebook = report["codebooks_differing_there"][0]
        groups = len(eager_codes[0])
        recorded = margins[frame * groups + codebook] if len(margins) >= groups * len(eager_codes) else None
        if recorded is not None:  # how close the eager run's choice was where the paths part
            top1, top2 = recorded
            report["first_difference_margin"] = {
                "codebook": codebook, "top1": round(top1, 5), "top1_minus_top2": round(top1 - top2, 5),
                "bf16_step_at_top1": 2.0 ** (math.floor(math.log2(abs(top1))) - 7) if top1 else 0.0}
    print(json.dumps(report))
    return 0 if report["tokens_equal"] and report["frames_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
