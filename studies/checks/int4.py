"""How far INT4 weights (int4.py) move the model: per quantized layer, per decoder layer and at the logits.

    python -m studies.checks.int4 --model synthetic:30b-a3b [--tokens 256] [--frames 64] [--sweep] [--out FILE]

One model in full precision, teacher-forced on the same inputs before and after `int4.quantize_model`:
- the Thinker's language model on `--tokens` random regular tokens (the library's forward, no cache);
- the Talker's decoder on `--frames` random codec tokens' embeddings, code 0 read from its codec head.
Prints one JSON object: for each quantized module kind (Thinker/Talker q, k, v, o, experts), the relative error
||int4 - full|| / ||full|| of its output on its own full-precision input (mean and worst over layers); the same
for each decoder layer's output hidden state (the residual stream, errors accumulated from the first layer);
the final logits' relative error; teacher-forced top-1 agreement of the Thinker's tokens and of the Talker's code 0;
the weight bytes before and after. With `--sweep` (GPU): the tile sizes of the int4 decode kernels, timed as
checks.moe's sweep does (moe.TILES), and the block size of int4.rows_kernel on the Thinker's projections.
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from typing import Any

import torch

from rtc_agent.engine.model.kernels import int4, moe
from rtc_agent.engine.model.loader import load

from .moe import graph_time_us, sweep_tiles


def _relative(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30)).item()


class _Recorder:
    """Each target module's inputs and output on its first call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.handles = [module.register_forward_hook(self._hook) for _, _, module in int4.targets(model)]

    def _hook(self, module, args, output) -> None:
        self.calls.setdefault(id(module), (tuple(a.detach() for a in args), output.detach()))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _teacher_forced(model, tokens: torch.Tensor, codec_embeds: torch.Tensor | None):
    """(Thinker logits [T, V], hidden states per layer, Talker code-0 logits [F, C] or None, its hidden states)."""
    text = model.thinker.model.language_model(input_ids=tokens, use_cache=False, output_hidden_states=True)
    logits = model.thinker.lm_head(text.last_hidden_state)[0]
    if codec_embeds is None:
        return logits, text.hidden_states, None, ()
    talker = model.talker.model(inputs_embeds=codec_embeds, use_cache=False, output_hidden_states=True)
    return logits, text.hidden_states, model.talker.codec_head(talker.last_hidden_state)[0], talker.hidden_states


def sweep(model, dtype: torch.dtype) -> dict[str, Any]:
    """Tile sizes of the int4 decode kernels on the quantized model (the rows of one decode step: 1 and 8)."""
    moe.install(model)
    stacks = {"thinker": [l.mlp for l in model.thinker.model.language_model.layers],
              "talker": [l.mlp for l in model.talker.model.layers]}
    generator = torch.Generator(device="cuda").manual_seed(0)
    result: dict[str, Any] = {}
    for rows in (1, 8):
        inputs = {name: [[torch.randn(rows, 1, b.experts.hidden_dim, device="cuda", generator=generator, dtype=dtype)]
                         for b in blocks] for name, blocks in stacks.items()}
        result[f"moe_rows_{rows}"] = sweep_tiles(stacks, inputs)
        projections = [getattr(l.self_attn, n) for l in model.thinker.model.language_model.layers
                       for n in int4.PROJECTIONS]
        xs = [torch.randn(rows, p.in_features, device="cuda", generator=generator, dtype=dtype) for p in projections]
        times = {}
        for tile in itertools.product((4, 8), (256, 512), (4, 8)):
            int4.ROWS_TILE = tile
            times[tile] = graph_time_us(lambda: [p(x) for p, x in zip(projections, xs)]) / len(projections)
        int4.ROWS_TILE = min(times, key=times.get)
        fastest = sorted(times.items(), key=lambda kv: kv[1])[:6]
        result[f"projection_rows_{rows}_us"] = {str(tile): round(us, 2) for tile, us in fastest}
    return result


@torch.inference_mode()
def check(model_spec: str, device: str, tokens: int, frames: int, tile_sweep: bool = False) -> dict[str, Any]:
    loaded = load(model_spec, device)
    model = loaded.model
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150_000, (1, tokens), generator=generator).to(loaded.device)
    codec_embeds = None
    if getattr(model, "talker", None) is not None:
        codes = torch.randint(0, model.config.talker_config.text_config.vocab_size - 4, (1, frames),
                              generator=generator).to(loaded.device)
        codec_embeds = model.talker.model.get_input_embeddings()(codes)
    recorder = _Recorder(model)
    logits, hidden, code_logits, talker_hidden = _teacher_forced(model, ids, codec_embeds)
    recorder.close()
    before = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))

    errors: dict[str, list[float]] = defaultdict(list)
    for parent, name, module in int4.targets(model):
        stack = "talker" if module in set(model.talker.modules() if codec_embeds is not None else ()) else "thinker"
        args, output = recorder.calls[id(module)]
        int4.quantize_module(parent, name, module)
        errors[f"{stack}.{name}"].append(_relative(getattr(parent, name)(*args), output))
    after = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    q_logits, q_hidden, q_code_logits, q_talker_hidden = _teacher_forced(model, ids, codec_embeds)

    result: dict[str, Any] = {
        "model": model_spec, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "tokens": tokens, "group_size": int4.GROUP,
        "weights_gb": {"before": round(before / 1e9, 4), "int4": round(after / 1e9, 4)},
        "module_relative_error": {kind: {"mean": round(sum(v) / len(v), 4), "max": round(max(v), 4), "count": len(v)}
                                  for kind, v in sorted(errors.items())},
        "thinker_layer_relative_error": [round(_relative(q, f), 4) for q, f in zip(q_hidden[1:], hidden[1:])],
        "logits_relative_error": round(_relative(q_logits, logits), 4),
        "thinker_top1_agreement": round((q_logits.argmax(-1) == logits.argmax(-1)).float().mean().item(), 4),
    }
    if code_logits is not None:
        result |= {
            "frames": frames,
            "talker_layer_relative_error": [round(_relative(q, f), 4)
                                            for q, f in zip(q_talker_hidden[1:], talker_hidden[1:])],
            "code0_logits_relative_error": round(_relative(q_code_logits, code_logits), 4),
            "code0_top1_agreement": round((q_code_logits.argmax(-1) == code_logits.argmax(-1)).float().mean().item(),
                                          4),
        }
    if tile_sweep:
        result["sweep"] = sweep(model, loaded.dtype)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.checks.int4", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--sweep", action="store_true", help="also sweep the int4 decode kernels' tiles (GPU)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    result = json.dumps(check(args.model, args.device, args.tokens, args.frames, args.sweep))
    print(result, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(result + "\n")


if __name__ == "__main__":
    main()
