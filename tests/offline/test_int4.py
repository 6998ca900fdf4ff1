"""INT4 weights (engine/model/kernels/int4.py): the format, the quantized tiny model end to end, the synthetic model's
int4 fill, and the Triton kernels' arithmetic under Triton's CPU interpreter against dequantize-then-matmul."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import caller_audio, engine_for, greedy, one_turn, run

from rtc_agent.engine.model import loader, tiny
from rtc_agent.engine.model.kernels import int4
from studies.checks import int4 as check_int4


@pytest.mark.parametrize("shape", [(40, 256), (3, 24, 384), (8, 64)])
def test_quantize_roundtrip_is_within_half_a_step(shape):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    packed, scale, offset = int4.quantize(weight)
    group = min(int4.GROUP, shape[-1])
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.shape == offset.shape == (*shape[:-1], shape[-1] // group)
    back = int4.dequantize(packed, scale, offset, torch.float32)
    step = scale.float().repeat_interleave(group, dim=-1)
    assert ((back - weight).abs() <= step / 2 + 1e-3 * step + 1e-6).all()
    assert 0 < (back - weight).norm() / weight.norm() < 0.11  # 16 levels a group: about 10 % on Gaussian weights


def test_sizes_that_cannot_be_grouped_are_refused():
    with pytest.raises(ValueError, match="groups of 128"):
        int4.quantize(torch.zeros(4, 96))


def test_quantized_tiny_model_replaces_experts_and_thinker_attention_and_answers():
    engine = engine_for(quantize="int4")
    assert engine.describe()["quantize"] == "int4"
    model = engine.model
    thinker_layers = model.thinker.model.language_model.layers
    assert all(isinstance(layer.mlp.experts, int4.Int4Experts) for layer in thinker_layers)
    assert all(isinstance(layer.self_attn.q_proj, int4.Int4Linear) for layer in thinker_layers)
    assert all(isinstance(layer.mlp.experts, int4.Int4Experts) for layer in model.talker.model.layers)
    assert not any(isinstance(m, int4.Int4Linear) for m in model.talker.modules())  # Talker attention stays
    session = engine.new_session(greedy(max_answer_tokens=8, max_frames=6))
    texts, frames, done = run(one_turn(session, caller_audio(1.5)))
    assert texts and frames and done.frames == len(frames) and not done.interrupted
    audio = np.concatenate([f.samples for f in frames])
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_synthetic_int4_fill_gives_the_quantized_full_precision_weights():
    """The synthetic model's int4 load fills and packs module by module; its weights must be those of the same
    model filled whole, then quantized (so benchmarks compare like with like)."""
    config = tiny.tiny_config_dict()
    device = torch.device("cpu")
    full, _ = loader._synthetic(config, device, torch.float32, False, "none", 0)
    packed, chosen = loader._synthetic(config, device, torch.float32, False, "int4", 0)
    assert chosen == "int4"
    modules = dict(packed.named_modules())
    checked = 0
    for name, module in full.named_modules():
        replacement = modules.get(name)
        if isinstance(replacement, int4.Int4Experts):
            pairs = ((module.gate_up_proj, replacement.gate_up), (module.down_proj, replacement.down))
        elif isinstance(replacement, int4.Int4Linear):
            pairs = ((module.weight, replacement.weight_int4),)
        else:
            continue
        for weight, quantized in pairs:
            for expected, got in zip(int4.quantize(weight), (quantized.packed, quantized.scale, quantized.offset)):
                assert torch.equal(expected, got), name
            checked += 1
    assert checked == len(int4.targets(full)) + sum(1 for _ in full.thinker.model.language_model.layers) \
        + sum(1 for _ in full.talker.model.layers)  # experts count twice (gate_up, down)
    others = dict(packed.named_parameters())
    for name, param in full.named_parameters():
        if name in others:
            assert torch.equal(param, others[name]), name


def test_check_int4_reports_bounded_nonzero_errors(capsys):
    check_int4.main(["--model", "tiny", "--device", "cpu", "--tokens", "32", "--frames", "16"])
    import json
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    errors = result["module_relative_error"]
    assert set(errors) == {"thinker.q_proj", "thinker.k_proj", "thinker.v_proj", "thinker.o_proj", "thinker.experts",
                           "talker.experts"}
    for kind, values in errors.items():  # 16 levels over a uniform group: ~6 % a matrix, ~11 % through an expert
        assert 0.02 < values["mean"] <= values["max"] < 0.15, (kind, values)
    assert 0 <= result["thinker_top1_agreement"] <= 1 and 0 <= result["code0_top1_agreement"] <= 1
    assert result["weights_gb"]["int4"] < result["weights_gb"]["before"]


_INTERPRETER_CHECK = """
import torch
from rtc_agent.engine.model import loader
from rtc_agent.engine.model.kernels import int4, moe
from test_moe import _blocks

def rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

generator = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    worst = {"rows": 0.0, "grouped": 0.0, "fused": 0.0}
    weight = int4.Int4Weight(torch.randn(72, 256, generator=generator).to(dtype))
    x = torch.randn(3, 256, generator=generator).to(dtype)
    worst["rows"] = rel(int4.rows_matmul(x, weight), torch.nn.functional.linear(x, weight.dequantized()))
    experts = int4.Int4Weight(torch.randn(3, 40, 256, generator=generator).to(dtype))  # rows no block divides
    assert torch.equal(int4.unpacked(weight), weight.dequantized()), "unpacked: not dequantize's values"
    assert torch.equal(int4.unpacked(experts), experts.dequantized()), "unpacked: not dequantize's values"
    model = loader.load("tiny", "cpu").model.to(dtype)
    int4.quantize_model(model)
    for block in _blocks(model, every=False):  # one of each class: the kernels' code is one for all of its blocks
        h = torch.randn(1, 100, block.experts.hidden_dim, generator=generator).to(dtype)  # > 16 rows an expert
        flat = h.view(-1, h.shape[-1])
        _, weights, selected = block.gate(flat)
        reference = block.experts._reference(flat, selected, weights)
        worst["grouped"] = max(worst["grouped"], rel(block.experts._grouped(flat, selected, weights), reference))
        one = h[:, :2].transpose(0, 1).contiguous()  # two rows of one position: a batched decode step
        worst["fused"] = max(worst["fused"], rel(moe.fused_forward(block, one), type(block).forward(block, one)))
    print(dtype, *worst.values())
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_int4_kernels_equal_dequantize_then_matmul_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True,
                         timeout=300, check=False, cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-3000:]
    fp32, bf16 = (list(map(float, line.split()[1:])) for line in out.stdout.strip().splitlines()[-2:])
    assert max(fp32) < 1e-5  # the same sums up to fp32 order
    assert max(bf16) < 0.02  # the outputs' own bf16 rounding (a step is 0.4-0.8 %), and the library rounding points
