"""The fused attention inputs (engine/model/kernels/rotary.py) give the library's attention: the same layer outputs and
the same keys and values in the cache, for every decoder stack of the tiny model, in a graph-mode step.

On the CPU the production hook keeps the library's path; what runs here is the same function with the plain-PyTorch
math always, and with the Triton kernel itself under Triton's CPU interpreter where Triton is installed.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtc_agent.engine.model import loader
from rtc_agent.engine.model.kernels import rotary
from rtc_agent.engine.model.kv_cache import StaticKVCache
from rtc_agent.engine.model.stack import run_stack


def _stacks(model):
    """(name, decoder stack, its config, whether its rotary is TMRoPE, sliding window) of every stack."""
    code2wav = model.code2wav.config
    return [("thinker", model.thinker.model.language_model, model.thinker.config.text_config, True, None),
            ("talker", model.talker.model, model.talker.config.text_config, True, None),
            ("predictor", model.talker.code_predictor.model, model.talker.code_predictor.config, False, None),
            ("code2wav", model.code2wav.pre_transformer, code2wav, False, code2wav.sliding_window)]


@contextlib.contextmanager
def _fused(stack, fn):
    """Every attention module of `stack` runs `rotary.fused_attention` with `fn` as its rotary math."""
    modules = [m for m in stack.modules() if rotary.is_attention(m)]
    assert modules
    for m in modules:
        m.forward = functools.partial(_fused_forward, m, fn)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def _fused_forward(module, fn, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    return rotary.fused_attention(module, hidden_states, position_embeddings, attention_mask, past_key_values, fn,
                                  **kwargs)


def _graph_step(stack, cache: StaticKVCache, embeds: torch.Tensor, mrope: bool) -> torch.Tensor:
    cache.begin(embeds.shape[1])
    cache.position.fill_(cache.length)
    out, _ = run_stack(stack, embeds, cache, mrope=mrope, graph_mode=True)
    cache.commit()
    return out


def max_differences(dtype: torch.dtype, fn) -> dict[str, float]:
    """For each stack: the largest difference, over the step's outputs and the cache's keys and values, between
    the library's attention and `fused_attention` with `fn`, on a graph-mode step of 3 positions after 5
    prefilled ones (Code2Wav: 9 after 70, past its sliding window)."""
    model = loader.load("tiny", "cpu").model.to(dtype)
    generator = torch.Generator().manual_seed(0)
    result = {}
    with torch.inference_mode():
        for name, stack, config, mrope, window in _stacks(model):
            for m in stack.modules():  # norm weights away from 1, so both roundings of the norm matter
                if getattr(m, "variance_epsilon", None) is not None:
                    m.weight.copy_(1.0 + 0.5 * torch.randn(m.weight.shape, generator=generator))
            before, count = (70, 9) if window else (5, 3)
            cache = StaticKVCache.for_config(config, before + count + 4, dtype, torch.device("cpu"), window=window)
            hidden = config.hidden_size
            run_stack(stack, torch.randn(1, before, hidden, generator=generator).to(dtype), cache, mrope=mrope)
            step = torch.randn(1, count, hidden, generator=generator).to(dtype)
            saved = [t.clone() for t in cache.keys + cache.values]
            reference = _graph_step(stack, cache, step, mrope)
            expected = [t.clone() for t in cache.keys + cache.values]
            cache.crop(before)
            for t, s in zip(cache.keys + cache.values, saved):
                t.copy_(s)
            with _fused(stack, fn):
                out = _graph_step(stack, cache, step, mrope)
            diffs = [(out.float() - reference.float()).abs().max().item()]
            diffs += [(a.float() - b.float()).abs().max().item() for a, b in zip(cache.keys + cache.values, expected)]
            result[name] = max(diffs)
    return result


def test_every_stack_has_patchable_attention():
    model = loader.load("tiny", "cpu").model
    names = {type(m).__name__ for m in model.modules() if rotary.is_attention(m)}
    assert names == rotary.CLASSES
    assert all(rotary._supported(m) for m in model.modules() if rotary.is_attention(m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_equals_library_attention(dtype):
    assert max(max_differences(dtype, rotary.rotary_torch).values()) == 0.0


def test_install_keeps_library_path_off_cuda_and_out_of_graphs():
    model = loader.load("tiny", "cpu").model
    modules = [m for m in model.modules() if rotary.is_attention(m)]
    assert rotary.install(model, enabled=False) == 0
    assert rotary.install(model) == len(modules)
    assert all(m._fast_path for m in modules)
    name, stack, config, mrope, _ = _stacks(model)[0]
    with torch.inference_mode():
        cache = StaticKVCache.for_config(config, 8, torch.float32, torch.device("cpu"))
        x = torch.randn(1, 3, config.hidden_size)
        out, _ = run_stack(stack, x, cache, mrope=mrope)  # CPU: the patched forward is the library's
        with rotary.library_rotary(model):
            assert not any(m._fast_path for m in modules)
            cache.crop(0)
            assert torch.equal(run_stack(stack, x, cache, mrope=mrope)[0], out)
    rotary.install(model, enabled=False)
    assert not rotary.active(model)


_INTERPRETER_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_rotary import max_differences
from rtc_agent.engine.model.kernels import rotary
assert rotary._KERNEL is not None
for dtype in (torch.float32, torch.bfloat16):
    print(max(max_differences(dtype, rotary.rotary_triton).values()))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_equals_library_attention_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERPRETER_CHECK.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    fp32, bf16 = (float(v) for v in out.stdout.split()[-2:])
    assert fp32 < 1e-4  # fp32 summation order of the norm only
    assert bf16 == 0.0  # the library's rounding points: on these inputs bit for bit
