"""Checks and times grouped.py's experts (prefill, and decode steps of many rows) against the library's and moe.py's
fused decode kernels on full-size MoE blocks alone (GPU).

    python -m studies.checks.grouped [--tokens 32 256 768 1536] [--sweep 32 768] [--decode 8 16 24] [--int4]

Builds `--layers` copies of the released Thinker and Talker MoE blocks (random weights, the model dtype; no whole
model is loaded, so it starts in seconds) and prints one JSON object:
- `blocks`: for each stack and token count, the largest difference from the library's block and the share of
  bit-identical elements;
- `us_per_layer`: the blocks one after another replayed as one CUDA graph, per block: the library's forward
  (`grouped_mm`), grouped.py's, and where `--int4` is given grouped.py's on INT4 experts; `x_layers_ms` the same
  times the stack's layer count (the MoE share of one prefill);
- `sort_us`: the library's sort of the pairs (64-bit keys) against grouped.route;
- with `--int4`, `projections_us`: the Thinker's attention projections (the other INT4 products of a prefill) at
  each token count, the library's bf16 linear layer against int4.Int4Linear;
- with `--sweep TOKENS`: at those token counts, each product's time at every tile and BLOCK_M tried, and the best
  per shape (for grouped.TILES);
- with `--decode ROWS`: a batched decode step's blocks (one position a row) at those row counts, µs per block in a
  graph: moe.py's fused kernels against the library's router and grouped.py's experts (what a step of
  moe.GROUPED_DECODE_ROWS rows or more takes), each also with every other row sitting the step out
  (`moe.skipping_rows`), and with `--int4` the same on INT4 experts (for moe.GROUPED_DECODE_ROWS).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import torch
import torch.nn.functional as F

from rtc_agent.engine.model import tiny
from rtc_agent.engine.model.kernels import grouped, int4, moe

from .moe import graph_time_us

DENSE_TILES = list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))  # BLOCK_N, BLOCK_K, warps, stages
INT4_TILES = list(itertools.product((64, 128), (0,), (4, 8), (2, 3)))


def blocks(stack: str, layers: int, dtype: torch.dtype) -> list[torch.nn.Module]:
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    config = Qwen3OmniMoeConfig(**tiny.released_config_dict())
    if stack == "thinker":
        text, cls = config.thinker_config.text_config, modeling.Qwen3OmniMoeThinkerTextSparseMoeBlock
    else:
        text, cls = config.talker_config.text_config, modeling.Qwen3OmniMoeTalkerTextSparseMoeBlock
    text._experts_implementation = "grouped_mm"  # what a loaded model's blocks run on CUDA (not set on a bare block)
    made = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(layers):
        with torch.device("cuda"):
            block = cls(text).to(dtype)
        for param in block.parameters():
            param.data.normal_(0.0, 0.02, generator=generator)
        moe.install(block)
        made.append(block.requires_grad_(False))
    return made


def projection_times(tokens: list[int]) -> dict:
    """The Thinker's q, k, v and o projections (random weights) over each token count: bf16 and INT4, in µs."""
    text = tiny.released_config_dict()["thinker_config"]["text_config"]
    hidden, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    shapes = {"q": (heads * text["head_dim"], hidden), "kv": (kv * text["head_dim"], hidden),
              "o": (hidden, heads * text["head_dim"])}
    result = {}
    for name, (n, k) in shapes.items():
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        quantized = int4.Int4Linear(linear).cuda()
        for count in tokens:
            x = torch.randn(count, k, device="cuda", dtype=torch.bfloat16)
            result[f"{name}/{count}"] = {"bf16": round(graph_time_us(lambda: F.linear(x, linear.weight)), 1),
                                         "int4": round(graph_time_us(lambda: quantized(x)), 1)}
    return result


def tile_sweep(block: torch.nn.Module, tokens: int, tiles: list, quant: bool) -> dict:
    """Each of the block's two products (gate_up, down) at every tile and every BLOCK_M, on this token count."""
    experts = block.experts
    x = torch.randn(tokens, block.gate.hidden_dim, device="cuda", dtype=torch.bfloat16)
    _, routing, selected = block.gate(x)
    gate_up, down = (experts.gate_up, experts.down) if quant else (experts.gate_up_proj, experts.down_proj)
    result = {}
    saved = dict(grouped.TILES)
    for block_m in (16, 32, 64):
        routes = grouped.route(selected, gate_up.shape[0], block_m)
        h = grouped.matmul(x, gate_up, routes, routes.tokens, routes.order, gated=True)
        for tile in tiles:
            for name, weight, args in (("gate_up", gate_up, (x, routes.tokens, routes.order, True, None)),
                                       ("down", down, (h, routes.order, routes.order, False, routing.reshape(-1)))):
                k, n = args[0].shape[-1], weight.shape[-2] // (2 if args[3] else 1)
                grouped.TILES[(k, n, args[3], quant, block_m)] = tile
                try:
                    us = graph_time_us(lambda: grouped.matmul(args[0], weight, routes, args[1], args[2], gated=args[3],
                                                              routing=args[4]), reps=20)
                except Exception as error:  # a tile that does not compile or fit: reported, not fatal
                    us = f"{type(error).__name__}: {str(error)[:80]}"
                result.setdefault(name, []).append({"block_m": block_m, "tile": tile, "us": us})
    grouped.TILES.clear()
    grouped.TILES.update(saved)
    for name, rows in result.items():
        timed = [r for r in rows if isinstance(r["us"], float)]
        result[name] = {"best": min(timed, key=lambda r: r["us"]), "all": rows}
    return result


def decode_times(variants: dict[str, list[torch.nn.Module]], rows: int) -> dict:
    """µs per block of a decode step of `rows` rows: each variant's blocks through the fused and the grouped path,
    all rows taking part and every other one."""
    hidden = next(iter(variants.values()))[0].gate.hidden_dim
    x = torch.randn(rows, 1, hidden, device="cuda", dtype=torch.bfloat16)
    half = (torch.arange(rows, device="cuda") % 2 == 0).to(torch.int32)
    paths = {"fused": moe.fused_forward, "grouped": moe.grouped_forward}
    result = {}
    for name, made in variants.items():
        for path, fn in paths.items():
            for taking_part, flags in (("all", None), ("half", half)):
                def step():
                    with moe.skipping_rows(flags) if flags is not None else contextlib.nullcontext():
                        return [fn(b, x) for b in made]
                result[f"{name}/{path}/{taking_part}"] = round(graph_time_us(step) / len(made), 1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 768, 1536])
    parser.add_argument("--layers", type=int, default=4, help="distinct blocks a graph runs (beyond the L2)")
    parser.add_argument("--sweep", type=int, nargs="*", metavar="TOKENS",
                        help="sweep the tiles at these token counts (of --tokens)")
    parser.add_argument("--decode", type=int, nargs="*", default=[], metavar="ROWS",
                        help="time decode steps of these row counts, fused against grouped")
    parser.add_argument("--int4", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    result: dict = {"blocks": {}, "us_per_layer": {}, "x_layers_ms": {}, "sort_us": {}, "sweep": {}, "decode_us": {}}
    if args.int4:
        with torch.inference_mode():
            result["projections_us"] = projection_times(args.tokens)
    counts = {"thinker": tiny.released_config_dict()["thinker_config"]["text_config"]["num_hidden_layers"],
              "talker": tiny.released_config_dict()["talker_config"]["text_config"]["num_hidden_layers"]}
    with torch.inference_mode():
        for stack in ("thinker", "talker"):
            made = blocks(stack, args.layers, dtype)
            quantized = blocks(stack, args.layers, dtype) if args.int4 else []
            for block in quantized:
                int4.quantize_module(block, "experts", block.experts)
            hidden = made[0].gate.hidden_dim
            for tokens in args.tokens:
                x = torch.randn(1, tokens, hidden, device="cuda", dtype=dtype)
                ours, library = made[0](x), type(made[0]).forward(made[0], x)
                key = f"{stack}/{tokens}"
                result["blocks"][key] = {
                    "max_abs_diff": (ours.float() - library.float()).abs().max().item(),
                    "max_abs": library.float().abs().max().item(),
                    "identical": (ours == library).float().mean().item()}
                times = {"library": graph_time_us(lambda: [type(b).forward(b, x) for b in made]) / len(made),
                         "grouped": graph_time_us(lambda: [b(x) for b in made]) / len(made)}
                if quantized:
                    times["grouped_int4"] = graph_time_us(lambda: [b(x) for b in quantized]) / len(quantized)
                result["us_per_layer"][key] = {name: round(us, 1) for name, us in times.items()}
                result["x_layers_ms"][key] = {name: round(us * counts[stack] / 1e3, 2) for name, us in times.items()}
                _, _, selected = made[0].gate(x.view(-1, hidden))
                ids = selected.reshape(-1)
                result["sort_us"][key] = {
                    "argsort_int64": round(graph_time_us(lambda: torch.argsort(ids)), 1),
                    "route": round(graph_time_us(lambda: grouped.route(selected, made[0].gate.num_experts)), 1)}
                if args.sweep and tokens in args.sweep:
                    result["sweep"][key] = tile_sweep(made[0], tokens, DENSE_TILES, False)
                    if quantized:
                        result["sweep"][key + "/int4"] = tile_sweep(quantized[0], tokens, INT4_TILES, True)
                print(json.dumps({key: [result[part].get(key) for part in ("blocks", "us_per_layer", "sort_us")]}),
                      flush=True)
            for rows in args.decode:
                variants = {"bf16": made, **({"int4": quantized} if quantized else {})}
                result["decode_us"][f"{stack}/{rows}"] = decode_times(variants, rows)
                print(json.dumps({f"{stack}/{rows}": result["decode_us"][f"{stack}/{rows}"]}), flush=True)
            # this stack's blocks go before the next stack's are made (`variants` still holds the two lists)
            made.clear()
            quantized.clear()
            torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
