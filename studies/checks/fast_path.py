"""Checks that the fast decode path (CUDA graphs, the single-token MoE, decode attention, fused RMSNorm and rotary
kernels, the device-side frame loop) makes the same greedy answer as the eager path (layers one by one, the
library's kernels) on one loaded model.

    python -m studies.checks.fast_path --model synthetic:30b-a3b --tokens 32 --frames 32 [--sessions 8]

Both paths answer the same turn greedily. With `--sessions N` the fast path answers N callers at once (each a
different turn, their audio in 1 s chunks: encoded, prefilled and decoded batched across the calls), and each answer
is compared with the eager path's answer to that caller alone. Where their answers part, bf16 rounding may have
turned a near-tie the other way; to tell that from an error, the eager path answers once more, made to take the fast
path's choices (every Thinker token, code 0 and code-predictor code), and at each choice the gap between its own
best score and the score of the fast path's choice is measured: 0 where they agree, a few bf16 steps (at the score's
magnitude) where the fast path took the other side of a near-tie, far more if the fast path computes something else.

Prints one JSON object; exits 0 when the answers are equal or every forced gap is within --tolerance-steps.

Prefills longer than a graph's (a system prompt) run eagerly on both paths, through the library's SDPA, but the
fast path leaves cuDNN's kernel out of them (`attention.LONG_PREFILL_BACKENDS`) and the library's attention does
not: their rounding differs before the first answer token. `--reference-long-prefills as-fast-path` gives the
eager path's long prefills the fast path's backends, so that only what the fast path changes is compared.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rtc_agent.engine.events import ResponseDone, SpeechFrame
from rtc_agent.engine.model.kernels import attention
from rtc_agent.engine.model.loader import load
from rtc_agent.engine.options import EngineOptions, SessionOptions
from rtc_agent.engine.scheduler import slots as slots_module
from rtc_agent.engine.session.engine import Engine
from rtc_agent.engine.step import talker as talker_module
from rtc_agent.engine.step.sampling import penalised_scores


async def _answer(engine: Engine, audio: np.ndarray, tokens: int, frames: int):
    return (await _answers(engine, [audio], tokens, frames))[0]


async def _answers(engine: Engine, audios: list[np.ndarray], tokens: int, frames: int) -> list[tuple[list, list]]:
    """Greedy answers (text ids, frame codes) of one caller per audio, all at once: their audio is pushed at the
    same moment, then every turn ends at the same moment."""
    options = SessionOptions(greedy=True, seed=0, max_answer_tokens=tokens, max_frames=frames)
    sessions = [engine.new_session(options) for _ in audios]

    async def respond(session) -> tuple[list, list]:
        codes, done = [], None
        async for event in session.respond():
            if isinstance(event, SpeechFrame):
                codes.append(event.codes)
            elif isinstance(event, ResponseDone):
                done = event
        return list(done.token_ids), codes

    try:
        await asyncio.gather(*(s.push_audio(a) for s, a in zip(sessions, audios)))
        return list(await asyncio.gather(*(respond(s) for s in sessions)))
    finally:
        for session in sessions:
            await session.close()


def _audio(index: int) -> np.ndarray:
    """Caller `index`'s turn: a tone of its own pitch and length (2 s for the first)."""
    t = np.arange(32000 + 4800 * index) / 16000
    return (0.2 * np.sin(2 * np.pi * (150 + 20 * index) * t)).astype(np.float32)


class _Forced:
    """The fast path's choices, imposed on an eager run in order, by kind; the gap of each is recorded."""

    def __init__(self, tokens: list[int], frames: list[tuple[int, ...]]) -> None:
        self.queues = {"thinker": list(tokens), "code0": [f[0] for f in frames],
                       "predictor": [c for f in frames for c in f[1:]]}
        self.gaps: dict[str, list[tuple[float, float]]] = {kind: [] for kind in self.queues}  # (gap, best score)

    def choose(self, kind: str, logits: torch.Tensor, sampling, seen=None, suppress=None) -> torch.Tensor:
        scores = penalised_scores(logits, sampling, seen, suppress)[0]
        best = int(scores.argmax())
        queue = self.queues[kind]
        forced = queue.pop(0) if queue else best  # past the fast path's answer: the eager path's own choice
        self.gaps[kind].append((float(scores[best] - scores[forced]), float(scores[best])))
        return torch.tensor([forced], device=logits.device)

    @contextlib.contextmanager
    def imposed(self):
        """Within the block the Thinker's, the Talker's and the code predictor's choices are this object's."""
        originals = slots_module.choose, talker_module.choose

        def thinker(logits, sampling, *args, **kwargs):
            return self.choose("thinker", logits, sampling)

        def talker(logits, sampling, generator=None, seen=None, suppress=None, noise=None, fused=False):
            return self.choose("code0" if seen is not None else "predictor", logits, sampling, seen, suppress)

        slots_module.choose, talker_module.choose = thinker, talker  # (an answer's first token too: first_tokens)
        try:
            yield
        finally:
            slots_module.choose, talker_module.choose = originals

    def report(self) -> dict:
        result = {}
        for kind, gaps in self.gaps.items():
            steps = [gap / _bf16_step(best) for gap, best in gaps]
            result[kind] = {"choices": len(gaps), "differing": sum(gap > 0 for gap, _ in gaps),
                            "max_gap": round(max((gap for gap, _ in gaps), default=0.0), 5),
                            "max_gap_bf16_steps": round(max(steps, default=0.0), 2)}
        return result


REFERENCE_ATTENTION = "rtc_agent_check_reference"


def _reference_attention(module, query, key, value, attention_mask, **kwargs):
    """The library's SDPA, with prefills longer than a graph's under the backends the fast path gives them."""
    if query.shape[2] <= attention.SHORT_QUERIES:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with sdpa_kernel(attention.LONG_PREFILL_BACKENDS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _long_prefills_as_fast_path(model) -> None:
    """The text stacks' library attention, long prefills on the fast path's backends (for the eager reference)."""
    AttentionInterface.register(REFERENCE_ATTENTION, _reference_attention)
    for config in attention.text_configs(model):
        config._attn_implementation = REFERENCE_ATTENTION


def _bf16_step(value: float) -> float:
    """The spacing of bf16 numbers at `value` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7) if value else 2.0 ** -133


def _first_difference(a: list, b: list) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:30b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=1, help="callers the fast path answers at once")
    parser.add_argument("--eager-kernels", choices=("library", "fast"), default="library",
                        help="MoE, decode attention and RMSNorm of the eager reference (fast: compares graphs alone)")
    parser.add_argument("--fast-kernels", choices=("fast", "library"), default="fast",
                        help="kernels of the graphed run (library: compares graphs alone)")
    parser.add_argument("--no-overlap", action="store_true", help="graphed run without the Thinker's side stream")
    parser.add_argument("--reference-long-prefills", choices=("library", "as-fast-path"), default="library",
                        help="backends of the eager reference's long prefills (with --eager-kernels library)")
    parser.add_argument("--tolerance-steps", type=float, default=4.0,
                        help="largest forced gap, in bf16 steps, still taken for a near-tie")
    args = parser.parse_args(argv)
    loaded = load(args.model, args.device)
    audios = [_audio(i) for i in range(args.sessions)]
    chunk_s = 1.0 if args.sessions > 1 else 0.0  # several callers: their 1 s chunks are what is batched
    options = dict(model=args.model, prefill_chunk_s=chunk_s, max_answer_tokens=args.tokens, max_frames=args.frames)

    def engine(graphs: bool, kernels: str, sessions: int) -> Engine:
        fast = kernels == "fast"
        return Engine(loaded, EngineOptions(cuda_graphs=graphs, fast_moe=fast, fast_attention=fast, fast_norm=fast,
                                            fast_rotary=fast, overlap=not args.no_overlap, max_sessions=sessions,
                                            **options))

    fast = engine(True, args.fast_kernels, args.sessions)
    answers = asyncio.run(_answers(fast, audios, args.tokens, args.frames))
    fast.close()
    del fast  # the eager engine's slots take its memory (the full-size model fits one engine's 8 slots, not two)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    eager = engine(False, args.eager_kernels, 1)  # one caller at a time: the reference is each caller alone
    if args.reference_long_prefills == "as-fast-path" and args.eager_kernels == "library":
        _long_prefills_as_fast_path(loaded.model)
    references = [asyncio.run(_answer(eager, audio, args.tokens, args.frames)) for audio in audios]
    reports = [_compare(reference, answer, eager, audio, args)
               for reference, answer, audio in zip(references, answers, audios)]
    passed = all(r["passed"] for r in reports)
    common = {"model": args.model, "sessions": args.sessions, "overlap": not args.no_overlap,
              "kernels": {"eager": args.eager_kernels, "graphs": args.fast_kernels},
              "reference_long_prefills": args.reference_long_prefills}
    print(json.dumps({**common, **reports[0]} if args.sessions == 1 else {**common, "passed": passed,
                                                                         "per_session": reports}))
    return 0 if passed else 1


def _compare(reference: tuple[list, list], answer: tuple[list, list], eager: Engine, audio: np.ndarray,
             args) -> dict:
    """One caller's fast answer against the eager one; where they part, the forced gaps of the eager path on the
    fast path's choices."""
    (eager_tokens, eager_codes), (fast_tokens, fast_codes) = reference, answer
    report = {
        "tokens_compared": len(eager_tokens), "frames_compared": len(eager_codes),
        "first_token_difference": _first_difference(eager_tokens, fast_tokens),
        "first_frame_difference": _first_difference(eager_codes, fast_codes),
        "tokens_equal": eager_tokens == fast_tokens, "frames_equal": eager_codes == fast_codes,
    }
    frame = report["first_frame_difference"]
    if frame is not None and frame < min(len(eager_codes), len(fast_codes)):
        report["codebooks_differing_there"] = [g for g, (a, b) in enumerate(zip(eager_codes[frame], fast_codes[frame]))
                                               if a != b]
    passed = report["tokens_equal"] and report["frames_equal"]
    if not passed:  # the eager path once more, on the fast path's choices
        forced = _Forced(fast_tokens, fast_codes)
        with forced.imposed():
            asyncio.run(_answer(eager, audio, args.tokens, args.frames))
        report["forced_gaps"] = forced.report()
        passed = all(kind["max_gap_bf16_steps"] <= args.tolerance_steps for kind in report["forced_gaps"].values())
    report["passed"] = passed
    return report


if __name__ == "__main__":
    raise SystemExit(main())
