"""Checks and times the single-token MoE path (moe.py) against the library's on one loaded model (GPU).

    python -m studies.checks.moe --model synthetic:30b-a3b [--sweep] [--stages] [--out FILE]

Prints one JSON object:
- `blocks`: every Thinker and Talker MoE block on random unit-RMS tokens, fast vs library: largest absolute
  difference, largest |library| and the share of bit-identical elements;
- `greedy`: the Thinker's own `generate` (library code, one token per step after the prompt), greedy, with the
  library's MoE and with the fast one: tokens equal, the largest logit difference while the prefixes agree and,
  where they part, the library's top-1 minus top-2 logit gap at that step;
- `layers_us`: all MoE blocks of each stack, one after another, replayed as one CUDA graph, per block:
  router alone, library (grouped_mm), library batched_mm, and the fast path;
- with `--sweep`: the Triton tile sizes tried and the best per shape (put into `moe.TILES` for what follows);
- with `--stages`: `bench`'s per-stage times of one session captured with the fast path and one without.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import time

import torch

from rtc_agent.engine.model.kernels import moe
from rtc_agent.engine.model.kernels.int4 import Int4Experts
from rtc_agent.engine.model.loader import load


def graph_time_us(fn, reps: int = 30, rounds: int = 1) -> float:
    """Device time of one `fn()` (a fixed sequence of kernels) replayed as one CUDA graph: the best of `rounds`
    means over `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return min(times)


def _library(block, x):
    return type(block).forward(block, x)  # the class's forward: never the patched one


def _batched_mm(block, x):
    from transformers.integrations.moe import batched_mm_experts_forward
    return moe.moe_forward(block, x, batched_mm_experts_forward)


def _fast(block, x):  # the production path (moe.block_forward's)
    return moe.fused_forward(block, x)


def _kernels_library_router(block, x):  # library router module, then the two kernels (shared expert fused)
    return moe.fused_forward(block, x, route_in_kernel=False)


def _experts_only(block, x):  # library router and shared expert modules, the kernels for the routed experts
    return moe.moe_forward(block, x, moe.experts_triton)


VARIANTS = {"fused": _fast, "kernels_library_router": _kernels_library_router, "experts_kernels_only": _experts_only}


def check_blocks(stacks, inputs) -> dict:
    result = {}
    for name, blocks in stacks.items():
        for variant, fn in {**VARIANTS, "library_batched_mm": _batched_mm}.items():  # the last: library vs library
            worst, scale, equal, total = 0.0, 0.0, 0, 0
            for block, xs in zip(blocks, inputs[name]):
                for x in xs:
                    ref, out = _library(block, x).float(), fn(block, x).float()
                    worst = max(worst, (ref - out).abs().max().item())
                    scale = max(scale, ref.abs().max().item())
                    equal += int((ref == out).sum())
                    total += ref.numel()
            result[f"{name} {variant}"] = {"max_abs_diff": worst, "max_abs_library": scale,
                                           "bit_identical_share": round(equal / total, 5)}
    return result


def check_ties(stacks, count: int = 32) -> dict:
    """Router rows repeated in threes (expert e gets row e // 3), so that the 8th and 9th choices tie exactly:
    which tied experts win must be the library's choice (torch.topk on CUDA) for the fused routing to be exact."""
    result = {}
    generator = torch.Generator(device="cuda").manual_seed(1)
    for name, blocks in stacks.items():
        block = blocks[0]
        saved = block.gate.weight.clone()
        experts = saved.shape[0]
        block.gate.weight.copy_(saved[torch.arange(experts, device=saved.device) // 3])
        mismatches, worst = 0, 0.0
        for _ in range(count):
            x = torch.randn(1, 1, saved.shape[1], device="cuda", generator=generator, dtype=saved.dtype)
            diff = (_library(block, x).float() - _fast(block, x).float()).abs().max().item()
            worst = max(worst, diff)
            mismatches += diff > 0.01
        block.gate.weight.copy_(saved)
        probs = torch.zeros(experts, device="cuda")
        probs[[5, 9, 17, 33, 40, 41, 77, 100, 101, 120]] = 1.0  # ten equal maxima: which eight does topk keep?
        kept = sorted(torch.topk(probs, blocks[0].gate.top_k).indices.tolist())
        result[name] = {"tokens": count, "mismatches": mismatches, "max_abs_diff": worst, "topk_kept_of_ten_ties": kept}
    return result


def _each(fn, blocks, xs) -> list:
    return [fn(b, x) for b, x in zip(blocks, xs)]


def time_layers(stacks, inputs) -> dict:
    result = {}
    for name, blocks in stacks.items():
        xs = [x[0] for x in inputs[name]]
        variants = {"router": lambda b, x: b.gate(x.view(-1, x.shape[-1])), "library_grouped_mm": _library,
                    "library_batched_mm": _batched_mm, **VARIANTS}
        result[name] = {key: round(graph_time_us(functools.partial(_each, f, blocks, xs)) / len(blocks), 2)
                        for key, f in variants.items()}
    return result


def sweep_tiles(stacks, inputs) -> dict:
    """Time the production path over all blocks of a stack for several tile sizes of each kernel (int4 blocks:
    BLOCK_N and warps only, their BLOCK_K being a quantization group)."""
    result = {}
    for name, blocks in stacks.items():
        e = blocks[0].experts
        quantized = isinstance(e, Int4Experts)
        key = (e.hidden_dim, e.intermediate_dim, blocks[0].gate.top_k, quantized)
        xs = [x[0] for x in inputs[name]]
        run = functools.partial(_each, _fast, blocks, xs)
        if quantized:
            candidates = [(bn, bk, w) for bn, bk, w in itertools.product((4, 8, 16, 32), (256, 512), (2, 4))]
        else:
            candidates = [(bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8, 16), (128, 256, 512), (4,))]
            candidates += [(bn, 256, w) for bn in (4, 8) for w in (2, 8)]
        times = {}
        best_up, best_down = moe.TILES.get(key, moe.DEFAULT_TILES)
        for tiles in candidates:  # gate_up tiles, down fixed
            moe.TILES[key] = (tiles, best_down)
            times[f"gate_up {tiles}"] = graph_time_us(run) / len(blocks)
        best_up = min(candidates, key=lambda t: times[f"gate_up {t}"])
        for tiles in candidates:  # down tiles, gate_up at its best
            moe.TILES[key] = (best_up, tiles)
            times[f"down {tiles}"] = graph_time_us(run) / len(blocks)
        best_down = min(candidates, key=lambda t: times[f"down {t}"])
        moe.TILES[key] = (best_up, best_down)
        result[name] = {"shape": key, "best": [best_up, best_down],
                        "best_us": round(graph_time_us(run) / len(blocks), 2),
                        "tried_us": {k: round(v, 2) for k, v in sorted(times.items(), key=lambda kv: kv[1])[:8]}}
    return result


def greedy_check(model, tokens: int, prompt_len: int = 64) -> dict:
    thinker = model.thinker
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 100000, (1, prompt_len), generator=generator).cuda()
    runs = {}
    for name, enabled in (("library", False), ("fast", True)):
        moe.install(model, enabled=enabled)
        out = thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                               do_sample=False, return_dict_in_generate=True, output_logits=True)
        runs[name] = (out.sequences[0, prompt_len:].tolist(), [l[0].float() for l in out.logits])
    (lib_ids, lib_logits), (fast_ids, fast_logits) = runs["library"], runs["fast"]
    first = next((i for i, (a, b) in enumerate(zip(lib_ids, fast_ids)) if a != b), None)
    agree = len(lib_ids) if first is None else first + 1  # logits are comparable up to the first differing token
    worst = max((lib_logits[i] - fast_logits[i]).abs().max().item() for i in range(agree))
    report = {"tokens": len(lib_ids), "tokens_equal": lib_ids == fast_ids, "first_difference": first,
              "max_logit_diff_on_equal_prefix": worst,
              "max_abs_logit": max(l.abs().max().item() for l in lib_logits[:agree])}
    if first is not None:
        top = lib_logits[first].topk(2).values
        report["library_top2_gap_at_difference"] = (top[0] - top[1]).item()
    return report


def talker_forced_check(model, steps: int = 32, prefix: int = 8) -> dict:
    """The Talker stack (library code) on the same random codec-embedding inputs, prefix then one position per
    step, with the library's MoE and with the fast one: codec_head logits compared step by step. Where the argmax
    differs, the library's top-1 minus top-2 gap says whether it was a bf16 near-tie."""
    from transformers import DynamicCache

    talker = model.talker
    device = next(talker.parameters()).device
    generator = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, 2048, (1, prefix + steps), device=device, generator=generator)
    embeds = talker.model.get_input_embeddings()(ids)
    logits, hiddens = {}, {}
    for name, enabled in (("library", False), ("fast", True)):
        moe.install(model, enabled=enabled)
        cache = DynamicCache(config=talker.model.config)
        talker.model(inputs_embeds=embeds[:, :prefix], past_key_values=cache, use_cache=True)
        logits[name], hiddens[name] = [], []
        for t in range(prefix, prefix + steps):
            hidden = talker.model(inputs_embeds=embeds[:, t:t + 1], past_key_values=cache, use_cache=True)
            hiddens[name].append(hidden.last_hidden_state[:, -1:])
            logits[name].append(talker.codec_head(hidden.last_hidden_state[:, -1])[0].float())
    lib, fast = torch.stack(logits["library"]), torch.stack(logits["fast"])
    differ = (lib.argmax(-1) != fast.argmax(-1)).nonzero().flatten().tolist()
    top2 = lib.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    report = {"steps": steps, "max_logit_diff": (lib - fast).abs().max().item(),
              "max_abs_logit": lib.abs().max().item(),
              "argmax_differs_at": differ, "library_top2_gap_there": [gaps[i] for i in differ],
              "steps_with_exact_top2_tie": sum(g == 0 for g in gaps), "median_top2_gap": sorted(gaps)[len(gaps) // 2]}
    # The (dense) code predictor, greedy, from each path's Talker hidden state and the same code 0: its 15 codes
    # chain 15 argmaxes over 2048 bf16 logits, where near-ties are common with random weights.
    frames_equal, partings = 0, []
    for step in range(steps):
        code0 = talker.get_input_embeddings()(lib[step].argmax().view(1, 1))
        runs = {}
        for name in ("library", "fast"):
            out = talker.code_predictor.generate(inputs_embeds=torch.cat((hiddens[name][step], code0), dim=1),
                                                 max_new_tokens=model.config.talker_config.num_code_groups - 1,
                                                 do_sample=False, return_dict_in_generate=True, output_logits=True)
            runs[name] = (out.sequences[0, -15:].tolist(), [l[0].float() for l in out.logits])
        (a, la), (b, lb) = runs["library"], runs["fast"]
        if a == b:
            frames_equal += 1
            continue
        group = next(g for g, (x, y) in enumerate(zip(a, b)) if x != y)
        top = la[group].topk(2).values
        partings.append({"step": step, "group": group + 1, "library_top2_gap": (top[0] - top[1]).item(),
                         "max_logit_diff_there": (la[group] - lb[group]).abs().max().item()})
    report["predictor"] = {"frames_equal": frames_equal, "of": steps, "first_partings": partings[:6]}
    return report


async def _session_stages(loaded, fast_moe: bool) -> dict:
    from rtc_agent.engine.bench import _caller_turn, _stage_times, _system_prompt
    from rtc_agent.engine.options import EngineOptions, SessionOptions
    from rtc_agent.engine.session.engine import Engine

    engine = Engine(loaded, EngineOptions(model=loaded.name, max_answer_tokens=16, max_frames=16, fast_moe=fast_moe))
    session = engine.new_session(SessionOptions(instructions=_system_prompt(engine.tokenizer, 200), seed=0,
                                                max_answer_tokens=8, max_frames=8))
    began = time.perf_counter()
    for _ in range(2):
        await session.push_audio(_caller_turn(2.0, seed=0))
        async for _ in session.respond():
            pass
    turns_s = time.perf_counter() - began
    stages = await engine.run(_stage_times, engine, [session.context])
    await session.close()
    engine.close()
    return {"fast_moe": fast_moe, "stage_ms": stages, "two_turns_s": round(turns_s, 2)}


async def _profile_thinker_step(loaded, steps: int = 3) -> dict:
    """Kernels of one eager Thinker decode step (fast MoE on): count and device time by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    from rtc_agent.engine.bench import _caller_turn
    from rtc_agent.engine.options import EngineOptions, SessionOptions
    from rtc_agent.engine.session.engine import Engine

    engine = Engine(loaded, EngineOptions(model=loaded.name, max_answer_tokens=16, max_frames=16, cuda_graphs=False))
    session = engine.new_session(SessionOptions(seed=0, max_answer_tokens=4, max_frames=4))
    await session.push_audio(_caller_turn(1.0, seed=0))
    async for _ in session.respond():
        pass
    context = session.context

    def decode() -> None:
        engine.pool.start_tokens([(context.slot, 0, context.generator)],
                                 [context.options.thinker_sampling], overlap=False)
        engine.pool.tokens()

    def job():
        decode()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                decode()
            torch.cuda.synchronize()
        return prof

    prof = await engine.run(job)
    await session.close()
    engine.close()
    rows = sorted(((e.key[:90], e.count / steps, e.device_time_total / steps)  # CUDA activity only: kernels
                   for e in prof.key_averages() if e.device_time_total > 0), key=lambda r: -r[2])
    return {"kernels_per_step": round(sum(r[1] for r in rows), 1),
            "kernel_us_per_step": round(sum(r[2] for r in rows), 1),
            "top": [[k, round(c, 1), round(t, 1)] for k, c, t in rows[:25]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:30b-a3b")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--profile", action="store_true", help="kernels of one eager Thinker step")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--parts", default="ties,blocks,layers,greedy,talker",
                        help="comma-separated: ties, blocks, layers, greedy, talker")
    args = parser.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def emit(key, value):
        report[key] = value
        print(json.dumps({key: value}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    started = time.perf_counter()
    loaded = load(args.model, "cuda")
    emit("load_s", round(time.perf_counter() - started, 1))
    model = loaded.model
    stacks = {"thinker": [l.mlp for l in model.thinker.model.language_model.layers],
              "talker": [l.mlp for l in model.talker.model.layers]}
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {name: [[torch.randn(1, 1, b.experts.hidden_dim, device="cuda", generator=generator, dtype=loaded.dtype)
                      for _ in range(4)] for b in blocks] for name, blocks in stacks.items()}
    parts = args.parts.split(",")
    with torch.inference_mode():
        if "ties" in parts:
            emit("ties", check_ties(stacks))
        if "blocks" in parts:
            emit("blocks", check_blocks(stacks, inputs))
        if args.sweep:
            emit("sweep", sweep_tiles(stacks, inputs))
            emit("tiles", {str(k): v for k, v in moe.TILES.items()})
        if "layers" in parts:
            emit("layers_us", time_layers(stacks, inputs))
        if "greedy" in parts:
            emit("greedy", greedy_check(model, args.tokens))
        if "talker" in parts:
            emit("talker_forced", talker_forced_check(model))
    if args.stages:
        for fast in (True, False):
            try:
                emit(f"stages_fast_{fast}", asyncio.run(_session_stages(loaded, fast)))
            except Exception as exc:  # noqa: BLE001  (the engine around the MoE changes: report, go on)
                emit(f"stages_fast_{fast}", {"error": repr(exc)[:2000]})
    if args.profile:
        try:
            emit("profile_thinker_step", asyncio.run(_profile_thinker_step(loaded)))
        except Exception as exc:  # noqa: BLE001
            emit("profile_thinker_step", {"error": repr(exc)[:2000]})
    emit("total_s", round(time.perf_counter() - started, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
