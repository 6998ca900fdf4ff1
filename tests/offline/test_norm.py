"""The fused RMSNorm (rtc_agent/engine/model/kernels/norm.py) gives the library's RMSNorm output.

On the CPU the production hook keeps the library's path; what runs here is the same math: the plain-PyTorch
formulation always, and the Triton kernel itself under Triton's CPU interpreter where Triton is installed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeRMSNorm,
)

from rtc_agent.engine.model import loader
from rtc_agent.engine.model.kernels import norm

# q_norm / k_norm see [B, T, heads, head_dim]; the others [B, T, hidden]
SHAPES = ((1, 1, None), (1, 5, None), (2, 3, None), (1, 1, 4, None), (1, 7, 3, None))


def _norms(model):
    return [m for m in model.modules() if norm.is_rms_norm(m)]


def max_differences(dtype: torch.dtype, fast) -> list[float]:
    """Largest |fast(x, weight, eps) - library module(x)| for every RMSNorm of the tiny model (random weights
    around 1, so the second rounding matters), over several leading shapes."""
    model = loader.load("tiny", "cpu").model
    generator = torch.Generator().manual_seed(0)
    result = []
    with torch.inference_mode():
        for module in _norms(model):
            width = module.weight.shape[0]
            module.weight.copy_(1.0 + 0.5 * torch.randn(width, generator=generator))
            module.to(dtype)
            for shape in SHAPES:
                x = (3.0 * torch.randn(*shape[:-1], width, generator=generator)).to(dtype)
                reference = type(module).forward(module, x)  # the class's forward: never a patched one
                out = fast(x, module.weight, module.variance_epsilon)
                assert out.shape == reference.shape and out.dtype == reference.dtype
                result.append((out.float() - reference.float()).abs().max().item())
    return result


def test_tiny_model_has_every_rms_norm_class():
    names = {type(m).__name__ for m in _norms(loader.load("tiny", "cpu").model)}
    assert names == norm.CLASSES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_equals_library_norm(dtype):
    assert max(max_differences(dtype, norm.rms_norm_torch)) == 0.0


def test_mixed_dtypes_follow_pytorch_promotion():
    module = Qwen3OmniMoeRMSNorm(16)  # fp32 weight, bf16 input: the library returns fp32
    x = torch.randn(2, 16).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(norm.rms_norm_torch(x, module.weight, module.variance_epsilon), module(x))


def test_install_keeps_library_path_off_cuda():
    model = loader.load("tiny", "cpu").model
    assert norm.install(model, enabled=False) == 0  # nothing patched where the fast path is off
    first = _norms(model)[0]
    assert "_library_forward" not in first.__dict__
    assert norm.install(model) == len(_norms(model))
    assert norm.install(model) == len(_norms(model))  # idempotent
    x = torch.randn(1, 3, first.weight.shape[0])
    with torch.inference_mode():
        assert torch.equal(first(x), first._library_forward(x))  # CPU: the patched forward is the library's
    assert not norm.active(model) or norm._KERNEL is not None
    with norm.library_norm(model):
        assert not any(m._fast_path for m in _norms(model))
    assert all(m._fast_path for m in _norms(model))
    norm.install(model, enabled=False)
    assert not norm.active(model)


_INTERPRETER_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_norm import max_differences
from rtc_agent.engine.model.kernels import norm
assert norm._KERNEL is not None
print(*(max(max_differences(dtype, norm.rms_norm_triton)) for dtype in (torch.float32, torch.bfloat16)))
weight, x = 1.0 + torch.randn(64), torch.randn(3, 2, 64).to(torch.bfloat16)  # fp32 weight, bf16 input: fp32 out
mixed = norm.rms_norm_triton(x, weight, 1e-6)
print(mixed.dtype == torch.float32, (mixed - norm.rms_norm_torch(x, weight, 1e-6)).abs().max().item())
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_equals_library_norm_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERPRETER_CHECK.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    fp32, bf16, mixed_dtype, mixed = out.stdout.split()[-4:]
    fp32, bf16, mixed = float(fp32), float(bf16), float(mixed)
    assert fp32 < 1e-5  # fp32 summation order only
    assert bf16 == 0.0  # the same rounding points as the library; on these inputs bit for bit
    assert mixed_dtype == "True" and mixed < 1e-5
