"""Triton where it is installed, and what the kernels share (moe.py, grouped.py, norm.py, rotary.py, sampling.py).

CPU-only installs have no Triton: `triton` is None there, no kernel is defined, and each of those modules keeps
the library's or plain PyTorch's path. CI runs the kernels on the CPU under Triton's interpreter.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:
    @triton.jit
    def rounded(x, dtype: tl.constexpr):
        """fp32 `x` rounded to `dtype` (to nearest even) and back to fp32: where the library's kernels store an
        intermediate in the model's dtype. bf16 by bit arithmetic, which Triton's CPU interpreter also runs
        exactly (its own bf16 cast truncates)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def silu_times(acc_gate, acc_up, dtype: tl.constexpr):
        """silu(gate) * up from fp32 dot products, rounded as the library rounds (matmul outputs, silu, product)."""
        gate = rounded(acc_gate, dtype)
        act = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
        return rounded(act * rounded(acc_up, dtype), dtype)
else:
    rounded = silu_times = None
