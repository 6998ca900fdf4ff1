"""The single-token MoE path (rtc_agent/engine/model/kernels/moe.py) gives the library's MoE block output for one token.

On the CPU the production hook keeps the library's path; what runs here is the same math: the plain-PyTorch
formulation always, and the Triton kernels themselves under Triton's CPU interpreter where Triton is installed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtc_agent.engine.model import loader
from rtc_agent.engine.model.kernels import moe


def _blocks(model, every: bool = True):
    """The model's MoE blocks; every=False: the first of each class (the kernels' code is one for all the blocks of a
    class: Triton's interpreter, at about 10 s a block, runs one Thinker block and the Talker's)."""
    blocks = [m for m in model.modules() if moe._is_moe_block(m)]
    first: dict[type, torch.nn.Module] = {}
    for block in blocks:
        first.setdefault(type(block), block)
    return blocks if every else list(first.values())


def max_differences(dtype: torch.dtype, fast, every: bool = True) -> list[float]:
    """Largest |fast(block, x) - library| of every MoE block of the tiny model (Thinker's and Talker's) on one
    token."""
    model = loader.load("tiny", "cpu").model.to(dtype)
    generator = torch.Generator().manual_seed(0)
    result = []
    with torch.inference_mode():
        for block in _blocks(model, every):
            for _ in range(3):
                x = torch.randn(1, 1, block.experts.hidden_dim, generator=generator).to(dtype)
                reference = block(x)
                out = fast(block, x)
                assert out.shape == reference.shape and out.dtype == reference.dtype
                result.append((out.float() - reference.float()).abs().max().item())
    return result


def test_tiny_model_has_thinker_and_talker_moe_blocks():
    names = {type(b).__name__ for b in _blocks(loader.load("tiny", "cpu").model)}
    assert names == {"Qwen3OmniMoeThinkerTextSparseMoeBlock", "Qwen3OmniMoeTalkerTextSparseMoeBlock"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_experts_equal_library_block(dtype):
    differences = max_differences(dtype, lambda block, x: moe.moe_forward(block, x, moe.experts_torch))
    if dtype == torch.bfloat16:  # the same rounding points as the library: bit for bit
        assert max(differences) == 0.0
    else:
        assert max(differences) < 1e-6


def test_install_keeps_library_path_off_cuda():
    model = loader.load("tiny", "cpu").model
    assert moe.install(model, enabled=False) == 0  # nothing patched where the fast path is off
    block = _blocks(model)[0]
    assert "_library_forward" not in block.__dict__
    assert moe.install(model) == len(_blocks(model))
    x = torch.randn(1, 1, block.experts.hidden_dim)
    with torch.inference_mode():
        assert torch.equal(block(x), block._library_forward(x))  # CPU: the patched forward is the library's
    with moe.library_path(model):
        assert not any(b._fast_path for b in _blocks(model))
    assert all(b._fast_path == moe._supported(b) for b in _blocks(model))


def skipped_rows_differences(path, every: bool = True) -> tuple[float, float]:
    """Rows that sit a step out (`moe.skipping_rows`): (largest |path - path without skipping| on the rows that
    take part, largest |output| on the rows left out) over every MoE block, 4 rows, flags as bool and as long."""
    model = loader.load("tiny", "cpu").model.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    kept = left_out = 0.0
    with torch.inference_mode():
        for block in _blocks(model, every):
            x = torch.randn(4, 1, block.experts.hidden_dim, generator=generator).to(torch.bfloat16)
            full = path(block, x)
            for active in (torch.tensor([True, False, True, False]), torch.tensor([0, 1, 1, 0])):
                with moe.skipping_rows(active):
                    out = path(block, x)
                on = active.bool()
                kept = max(kept, (out[on].float() - full[on].float()).abs().max().item())
                left_out = max(left_out, out[~on].float().abs().max().item())
    return kept, left_out


_INTERPRETER_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_moe import max_differences, skipped_rows_differences
from rtc_agent.engine.model.kernels import moe
assert moe._KERNELS is not None
paths = (lambda b, x: moe.moe_forward(b, x, moe.experts_triton), moe.fused_forward)  # library router; fused
print(*skipped_rows_differences(moe.fused_forward, False), *skipped_rows_differences(moe.grouped_forward, False),
      *(max(max_differences(dtype, path, False)) for path in paths for dtype in (torch.float32, torch.bfloat16)))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_equal_library_block_and_skip_rows_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERPRETER_CHECK.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    kept, left_out, grouped_kept, grouped_left_out, fp32, bf16, fused_fp32, fused_bf16 = \
        map(float, out.stdout.split()[-8:])
    assert fp32 < 1e-6 and fused_fp32 < 1e-6
    assert bf16 == 0.0 and fused_bf16 == 0.0  # the same rounding points as the library; on these inputs bit for bit
    # rows left out of a step: zeros; the others exactly as without it (the fused kernels, and grouped.py's, which
    # a step of many rows takes)
    assert kept == 0.0 and left_out == 0.0
    assert grouped_kept == 0.0 and grouped_left_out == 0.0
