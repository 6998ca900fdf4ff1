"""Triton where it is installed, and what the kernels share (moe.py, grouped.py, int4.py, norm.py, rotary.py,
sampling.py).

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
    def int4_weights(codes, scale, offset, dtype: tl.constexpr, BITWISE: tl.constexpr):
        """INT4 codes (int32, 0..15; int4.py's format) as weights in `dtype`: code * scale + offset in fp32, rounded
        once. The code's float is the code put in the mantissa of 2^23, minus 2^23: an OR and an add, where a
        conversion instruction runs at a fraction of the multiply-adds' rate (the dequantization bounds grouped.py's
        INT4 products: a Thinker MoE layer at 768 positions 562 -> 439 us with this and the tiles swept,
        `python -m studies.checks.grouped --int4 --tokens 768`). BITWISE: rounded by bit arithmetic (Triton's
        interpreter, whose bf16 cast truncates) instead of the hardware's cast; both round to nearest even."""
        w = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * scale + offset
        if BITWISE:
            return rounded(w, dtype).to(dtype)
        return w.to(dtype)

    @triton.jit
    def silu_times(acc_gate, acc_up, dtype: tl.constexpr):
        """silu(gate) * up from fp32 dot products, rounded as the library rounds (matmul outputs, silu, product)."""
        gate = rounded(acc_gate, dtype)
        act = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
        return rounded(act * rounded(acc_up, dtype), dtype)
else:
    rounded = int4_weights = silu_times = None
