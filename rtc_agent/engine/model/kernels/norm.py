"""RMSNorm in one kernel: every RMSNorm of the Thinker, the Talker, its code predictor and Code2Wav's transformer.

Why: the library's `Qwen3OmniMoe*RMSNorm.forward` is seven elementwise kernels (to fp32, pow, mean, add eps,
rsqrt, mul, to dtype, and the weight multiply). A decode layer has four norms (input, post-attention, q_norm,
k_norm), so on the Thinker they are ~1350 of the ~2730 kernels of one token, and a graphed step is bound by kernel
count rather than by bytes (docs/performance.md). The same norms sit in the Talker (20 layers), the code predictor
(5 layers x 15 steps per frame) and Code2Wav's transformer.

What: one Triton kernel per norm, any leading shape (q_norm and k_norm act on [B, T, heads, head_dim]), with the
library's rounding points: the sum of squares, the mean and the reciprocal square root in fp32, the normalised
value rounded to the input dtype, then multiplied by the weight and rounded to the result dtype PyTorch gives
`weight * normalised` (bf16 * bf16: the product in fp32, rounded to bf16). Results differ from the library only
where the fp32 sum of squares, summed in another order, moves a normalised value across a rounding boundary: one
step of the input dtype, most elements bit-identical.

Where: `install(model)` patches the RMSNorm modules' `forward`; the kernel runs on CUDA with Triton present and a
contiguous input; the CPU and anything else call the library's forward unchanged. `rms_norm_torch` is the same
math in plain PyTorch (the reference for the CPU test); the kernel itself is tested on the CPU under Triton's
interpreter (tests/offline/test_norm.py). `torch.nn.functional.rms_norm` is not used: with a weight it rounds once
(x * rstd * weight in fp32), not twice as the library does (measured in docs/performance.md).
"""
from __future__ import annotations

import torch
from torch import nn

from . import fast_path
from .triton_support import rounded, tl, triton

# The library's RMSNorm classes in modeling_qwen3_omni_moe (all with the forward above). The vision and audio
# encoders' LayerNorms are not among them.
CLASSES = frozenset({"Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm", "Qwen3OmniMoeRMSNorm",
                     "Qwen3OmniMoeCode2WavRMSNorm"})
MAX_WIDTH = 16384  # wider rows (none in this model) keep the library's path: one tile holds a whole row


def is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__ in CLASSES and hasattr(module, "weight") and hasattr(module, "variance_epsilon")


def install(model: nn.Module, enabled: bool = True) -> int:
    """Route every RMSNorm of `model` through `norm_forward` (see fast_path.install)."""
    return fast_path.install(model, is_rms_norm, norm_forward, enabled)


def active(model: nn.Module) -> bool:
    """Whether CUDA runs of `model` take the fused norm (installed, enabled, Triton present)."""
    return _KERNEL is not None and fast_path.enabled(model, is_rms_norm)


def library_norm(model: nn.Module):
    """Within the block, every RMSNorm of `model` runs the library's own forward (e.g. for stock `generate`)."""
    return fast_path.library(model, is_rms_norm)


def norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Forward of a patched RMSNorm: the fused kernel on CUDA, the library's otherwise."""
    if not (self._fast_path and hidden_states.is_cuda and _KERNEL is not None and hidden_states.is_contiguous()
            and hidden_states.shape[-1] <= MAX_WIDTH and hidden_states.numel() > 0):
        return self._library_forward(hidden_states)
    return rms_norm_triton(hidden_states, self.weight, self.variance_epsilon)


def rms_norm_torch(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The library's RMSNorm math in plain PyTorch, rounding where it rounds (the reference for the kernel)."""
    x = hidden_states.to(torch.float32)
    normalised = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalised.to(hidden_states.dtype)


def rms_norm_triton(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_torch` as one Triton kernel: `hidden_states` [..., N] contiguous, `weight` [N]."""
    width = hidden_states.shape[-1]
    x = hidden_states.view(-1, width)
    rows = x.shape[0]
    out = torch.empty(hidden_states.shape, dtype=torch.promote_types(weight.dtype, hidden_states.dtype),
                      device=hidden_states.device)
    block_n = triton.next_power_of_2(width)
    block_m = max(1, min(2048 // block_n, triton.next_power_of_2(rows)))  # several short rows (q/k heads) a program
    warps = 8 if block_m * block_n >= 8192 else 4 if block_m * block_n >= 1024 else 2 if block_m * block_n >= 256 else 1
    _KERNEL[(triton.cdiv(rows, block_m),)](x, weight, out, rows, float(eps), N=width, BLOCK_M=block_m,
                                           BLOCK_N=block_n, num_warps=warps)
    return out


_KERNEL = None  # where Triton is installed
if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, eps, N: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        """BLOCK_M rows of N per program: fp32 mean of squares, x * rsqrt(mean + eps) rounded to x's dtype, times
        the weight, rounded to out's dtype."""
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col = tl.arange(0, BLOCK_N)
        col_ok = col < N
        ok = (row < rows)[:, None] & col_ok[None, :]
        offsets = row[:, None].to(tl.int64) * N + col[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=1) * (1.0 / N)  # CUDA's mean multiplies by 1/N
        normalised = rounded(x * tl.math.rsqrt(variance + eps)[:, None], x_ptr.dtype.element_ty)
        weight = tl.load(w_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
        result = rounded(normalised * weight[None, :], out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=ok)

    _KERNEL = rms_norm_kernel
