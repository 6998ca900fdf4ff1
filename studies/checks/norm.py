"""Checks and times the fused RMSNorm (norm.py) against the library's and `torch.nn.functional.rms_norm` (GPU).

    python -m studies.checks.norm [--positions 1,32]

No weights are loaded: the released architecture is built on the meta device to list its RMSNorms (class, width,
eps, and for q_norm / k_norm the heads), and each is made again on the GPU in bf16 with random weights around 1 (so
the rounding after the weight multiply matters). Prints one JSON object:
- `kernels`: CUDA kernels per call of each variant (torch.profiler), one Thinker input norm on one position;
- `equality`: each variant against the library's forward over every norm of the model on random inputs: largest
  absolute difference, largest difference in bf16 steps of the library's value, share of bit-identical elements;
- `graph_us`: all norms of each stack (Thinker, Talker, code predictor, Code2Wav) one after another as one CUDA
  graph, per position count: µs per graph replay and per norm, for each variant.

Variants: `library` (the class's forward, seven elementwise kernels), `triton` (norm.rms_norm_triton),
`f_rms_norm` (`F.rms_norm(x, shape, weight, eps)`: rounds once, after the weight), `f_rms_norm_then_weight`
(`F.rms_norm` without weight, in the input dtype, then `weight *`: the library's two rounding points).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from rtc_agent.engine.model import tiny
from rtc_agent.engine.model.kernels import norm

from .moe import graph_time_us

STACKS = {"thinker": "thinker.", "talker": "talker.model.", "code_predictor": "talker.code_predictor.",
          "code2wav": "code2wav."}


def _library(module, x):
    return type(module).forward(module, x)


VARIANTS = {
    "library": _library,
    "triton": lambda m, x: norm.rms_norm_triton(x, m.weight, m.variance_epsilon),
    "f_rms_norm": lambda m, x: F.rms_norm(x, (x.shape[-1],), m.weight, m.variance_epsilon),
    "f_rms_norm_then_weight": lambda m, x: m.weight * F.rms_norm(x, (x.shape[-1],), None, m.variance_epsilon),
}


def released_norms(device: torch.device, dtype: torch.dtype) -> dict[str, list[tuple[torch.nn.Module, int]]]:
    """Every RMSNorm of the released architecture in forward order, per stack: (module on `device` with random
    weights, heads: 0 for [B, T, hidden] inputs, else the heads of [B, T, heads, head_dim])."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
    config = Qwen3OmniMoeConfig(**(tiny.released_config_dict() | {"enable_audio_output": True}))
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    modules = dict(model.named_modules())
    generator = torch.Generator().manual_seed(0)
    stacks: dict[str, list] = {name: [] for name in STACKS}
    for name, module in model.named_modules():
        if not norm.is_rms_norm(module):
            continue
        stack = next((s for s, prefix in reversed(STACKS.items()) if name.startswith(prefix)), None)
        if stack is None:
            continue
        leaf = name.rsplit(".", 1)[-1]
        heads = 0
        if leaf in ("q_norm", "k_norm"):
            parent = modules[name.rsplit(".", 1)[0]].config
            heads = parent.num_attention_heads if leaf == "q_norm" else parent.num_key_value_heads
        width = module.weight.shape[0]
        real = type(module)(width, module.variance_epsilon)
        with torch.no_grad():
            real.weight.copy_(1.0 + 0.3 * torch.randn(width, generator=generator))
        stacks[stack].append((real.to(device, dtype), heads))
    return stacks


def _input(module, heads: int, positions: int, generator: torch.Generator) -> torch.Tensor:
    width = module.weight.shape[0]
    shape = (1, positions, heads, width) if heads else (1, positions, width)
    return (2.0 * torch.randn(*shape, generator=generator, device=module.weight.device)).to(module.weight.dtype)


def _steps(diff: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |diff| in units of the bf16 step at the reference's magnitude."""
    _, exponent = torch.frexp(reference.float().abs().clamp_min(1e-30))
    return float((diff / torch.ldexp(torch.ones_like(diff), exponent - 8)).max())


def _kernels_per_call(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", default="1,32", help="position counts to time, comma-separated")
    args = parser.parse_args()
    device = torch.device("cuda")
    assert norm._KERNEL is not None, "Triton is not installed"
    stacks = released_norms(device, torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(1)
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device),
                    "norms": {stack: len(norms) for stack, norms in stacks.items()}}
    with torch.inference_mode():
        first, heads = stacks["thinker"][0]
        x = _input(first, heads, 1, generator)
        report["kernels"] = {name: _kernels_per_call(lambda fn=fn: fn(first, x)) for name, fn in VARIANTS.items()}
        equality = {name: {"max_abs": 0.0, "max_steps": 0.0, "identical": 0, "elements": 0} for name in VARIANTS}
        for norms in stacks.values():
            for module, heads in norms:
                for positions in (1, 7):
                    x = _input(module, heads, positions, generator)
                    reference = _library(module, x)
                    for name, fn in VARIANTS.items():
                        out = fn(module, x)
                        assert out.shape == reference.shape and out.dtype == reference.dtype, name
                        diff = (out.float() - reference.float()).abs()
                        row = equality[name]
                        row["max_abs"] = max(row["max_abs"], float(diff.max()))
                        row["max_steps"] = max(row["max_steps"], _steps(diff, reference))
                        row["identical"] += int((out == reference).sum())
                        row["elements"] += out.numel()
        report["equality"] = {name: {"max_abs": row["max_abs"], "max_steps": round(row["max_steps"], 3),
                                     "identical_share": round(row["identical"] / row["elements"], 6)}
                              for name, row in equality.items()}
        report["graph_us"] = {}
        for positions in (int(p) for p in args.positions.split(",")):
            for stack, norms in stacks.items():
                inputs = [(module, _input(module, heads, positions, generator)) for module, heads in norms]
                row = {}
                for name, fn in VARIANTS.items():
                    total = graph_time_us(lambda fn=fn, inputs=inputs: [fn(module, x) for module, x in inputs], 50, 3)
                    row[name] = {"graph": round(total, 1), "per_norm": round(total / len(inputs), 2)}
                report["graph_us"][f"{stack}@{positions}"] = row
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
