"""Weight-only INT4 (group size 128, asymmetric) for the MoE experts and the Thinker's attention projections.

Format: a weight W [..., N, K] (N outputs, K inputs) is cut along K into groups of G = 128 (or K itself where K is
smaller, as in the tiny model); each group keeps a float16 `scale` and `offset` (its min) and 4-bit codes q in
0..15, so that W ~ q * scale + offset. Two codes share a byte: byte j of a group holds element j (low nibble) and
element j + G/2 (high nibble), so a kernel multiplies the low nibbles with the group's first half of the inputs and
the high ones with the second half, with no shuffle. 4.25 bits a weight (bf16: 16). Asymmetric because it costs
one multiply-add per group in the kernel (sum(w x) = scale * sum(q x) + offset * sum(x)) and never does worse
than symmetric on a skewed group.

What is quantized and what stays: `quantize_model` replaces the experts of every MoE block, Thinker's and Talker's
(32 of the 35 B parameters), and the q/k/v/o projections of the Thinker's decoder layers (1.1 B). Embeddings, the LM
and codec heads, norms, routers, the Talker's attention and shared expert, the code predictor, the audio and vision
encoders and Code2Wav stay in the model dtype: together about 2.2 B parameters; the heads and routers decide tokens
directly (their errors are not averaged out), and the Talker's small dense parts run in every 80 ms frame, where
int4 kernels measured slower than the library's bf16 ones for 0.14 GB saved (docs/performance.md).

Kernels (Triton): grouped.py's matmul over rows grouped by expert (`tl.dot` on tiles dequantized in registers)
for the experts in prefill and in decode steps of 16 rows or more; `rows_kernel`, dot products of a few rows (a
decode step, one row per session) with many small blocks of weight rows, so that a step's few rows still spread
over the whole GPU; moe.py's single-token MoE kernels read the same packed format for smaller decode steps
(`rows_dot`). Linear layers over more rows (prefill) unpack
their weight into a scratch copy in the model dtype (`unpacked`) for the library's GEMM: a product on tiles
dequantized in registers dequantizes the weight again for every tile of rows, and took twice as long (the
Thinker's q projection at 768 rows 44 against 26 µs on the H200; `python -m studies.checks.grouped
--int4 --tokens 768`, `projections_us`).
Without CUDA and Triton (the CPU), the math is done by dequantizing first, which is also the reference the tests
hold the kernels to under Triton's interpreter.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import grouped
from .triton_support import int4_weights, tl, triton

log = logging.getLogger(__name__)

GROUP = 128
QUANTIZE_CHUNK = 8  # experts quantized at once
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [..., N, K] -> (packed uint8 [..., N, K/2], scale fp16 [..., N, K/G], offset fp16 [..., N, K/G])."""
    if weight.ndim == 3 and weight.shape[0] > QUANTIZE_CHUNK:  # experts a few at a time: bounded scratch memory
        parts = [quantize(chunk) for chunk in weight.split(QUANTIZE_CHUNK)]
        return tuple(torch.cat(tensors) for tensors in zip(*parts))
    *lead, n, k = weight.shape
    group = group_size(k)
    groups = weight.float().reshape(*lead, n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    offset = low.half()
    scale = ((high - low) / 15).clamp_min(1e-8).half()
    codes = ((groups - offset.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, 15)
    codes = codes.to(torch.uint8)
    packed = codes[..., : group // 2] | (codes[..., group // 2:] << 4)
    return packed.reshape(*lead, n, k // 2), scale, offset


def group_size(k: int) -> int:
    """GROUP, or k where k is smaller (a power of two >= 32, for the kernels' tiles)."""
    group = min(GROUP, k)
    if k % group or group < 32 or group & (group - 1):
        raise ValueError(f"int4: an input size of {k} cannot be cut into groups of {GROUP} (or one power-of-two "
                         "group of at least 32)")
    return group


def dequantize(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize` (up to the rounding): W [..., N, K] in `dtype`."""
    *lead, n, half_k = packed.shape
    group = group_size(half_k * 2)
    groups = packed.reshape(*lead, n, half_k * 2 // group, group // 2)
    codes = torch.cat((groups & 15, groups >> 4), dim=-1).float()
    weight = codes * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    return weight.reshape(*lead, n, half_k * 2).to(dtype)


class Int4Weight(nn.Module):
    """A packed weight [..., N, K] as three buffers (so `.to(device)` and `state_dict` carry them)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        packed, scale, offset = quantize(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.group = group_size(weight.shape[-1])

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.offset, self.dtype)


def _kernels_on(x: torch.Tensor) -> bool:
    return x.is_cuda and _ROWS_KERNEL is not None


class Int4Linear(nn.Module):
    """nn.Linear without bias, weights in INT4."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("int4: linear layers with a bias are not quantized")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int4 = Int4Weight(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not _kernels_on(x):
            out = F.linear(rows, self.weight_int4.dequantized())
        elif rows.shape[0] <= DECODE_ROWS:
            out = rows_matmul(rows, self.weight_int4)
        else:
            out = F.linear(rows, unpacked(self.weight_int4))
        return out.view(*x.shape[:-1], self.out_features)


class Int4Experts(nn.Module):
    """A MoE block's experts (the library's `...TextExperts`: gate_up [E, 2I, H], down [E, H, I]) in INT4, with the
    library's call signature: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts.down_proj.shape[0], \
            experts.hidden_dim, experts.intermediate_dim
        self.act_fn = experts.act_fn
        self.gate_up = Int4Weight(experts.gate_up_proj.detach())
        self.down = Int4Weight(experts.down_proj.detach())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if _kernels_on(hidden_states):
            return self._grouped(hidden_states, top_k_index, top_k_weights)
        return self._reference(hidden_states, top_k_index, top_k_weights)

    def _reference(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Dequantize the chosen experts, then the library's math (gather + batched matmuls)."""
        tokens, top_k = index.shape
        ids = index.reshape(-1)
        gate_up = dequantize(self.gate_up.packed[ids], self.gate_up.scale[ids], self.gate_up.offset[ids], x.dtype)
        gate, up = torch.bmm(gate_up, x.repeat_interleave(top_k, 0).unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        down = dequantize(self.down.packed[ids], self.down.scale[ids], self.down.offset[ids], x.dtype)
        y = torch.bmm(down, h.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)

    def _grouped(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """grouped.py's experts: pairs grouped by expert, each expert's in tiles; no host synchronisation, so it is
        captured in CUDA graphs."""
        return grouped.experts(x, index, weights, self.gate_up, self.down)


DECODE_ROWS = 16  # up to this many rows, linear layers take `rows_kernel`
ROWS_TILE = (4, 512, 8)  # `rows_kernel`: weight rows a program reads, bytes of each a step, warps (a sweep: H200)


def rows_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [M, K] @ W^T for a few rows: one program per (row, block of weight rows)."""
    count, k = x.shape
    n = weight.shape[-2]
    x = x.contiguous()
    out = torch.empty(count, n, dtype=x.dtype, device=x.device)
    block_n, block_b, warps = ROWS_TILE
    _ROWS_KERNEL[(count, -(-n // block_n))](x, weight.packed, weight.scale, weight.offset, out, n, K=k, G=weight.group,
                                            BLOCK_N=block_n, BLOCK_B=block_b, num_warps=warps)
    return out


UNPACK_ROWS = 32  # weight rows a program of `unpack_kernel` writes


def unpacked(weight: Int4Weight) -> torch.Tensor:
    """`dequantize`'s weight in one Triton kernel, for the library's GEMM over many rows: a scratch copy in the model
    dtype, 16 MB for the Thinker's largest projection (7 µs on the H200; `dequantize`'s torch ops with the GEMM took
    110-130 µs there)."""
    *lead, n, k = weight.shape
    rows = n * math.prod(lead)
    out = torch.empty(weight.shape, dtype=weight.dtype, device=weight.packed.device)
    _UNPACK_KERNEL[(-(-rows // UNPACK_ROWS), k // weight.group)](
        weight.packed, weight.scale, weight.offset, out, rows, K=k, G=weight.group, BLOCK_R=UNPACK_ROWS)
    return out


def targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every module `quantize_model` replaces."""
    found = []
    for stack in _decoder_stacks(model):
        for layer in stack.layers:
            if stack is model.thinker.model.language_model:
                found += [(layer.self_attn, name, getattr(layer.self_attn, name)) for name in PROJECTIONS]
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None and hasattr(experts, "gate_up_proj"):
                found.append((layer.mlp, "experts", experts))
    return found


def _decoder_stacks(model: nn.Module) -> list[nn.Module]:
    stacks = [model.thinker.model.language_model]
    if getattr(model, "talker", None) is not None:
        stacks.append(model.talker.model)
    return stacks


@torch.no_grad()
def quantize_model(model: nn.Module, device: torch.device | None = None) -> int:
    """Replace the experts and attention projections of the Thinker and Talker (see the module docstring) with INT4
    ones, one module at a time, each moved to `device` first (so the full-precision weights never all sit on the
    GPU). Returns the bytes saved."""
    saved = 0
    for parent, name, module in targets(model):
        if device is not None:
            module.to(device)
        saved += quantize_module(parent, name, module)
    log.info("int4: experts and attention projections quantized, %.2f GB of weights saved", saved / 1e9)
    return saved


def quantize_module(parent: nn.Module, name: str, module: nn.Module) -> int:
    """Put the INT4 version of `module` (a target) in its place and free its weights; returns the bytes saved."""
    replacement = Int4Experts(module) if name == "experts" else Int4Linear(module)
    before = sum(p.numel() * p.element_size() for p in module.parameters())
    setattr(parent, name, replacement)
    module.to("meta")  # frees its full-precision weights now, not when the model is done
    return before - sum(b.numel() * b.element_size() for b in replacement.buffers())


_ROWS_KERNEL = _UNPACK_KERNEL = rows_dot = None  # the kernels, where Triton is installed
if triton is not None:

    @triton.jit
    def rows_dot(q_rows, s_rows, o_rows, v_row, row_ok, K: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_B: tl.constexpr):
        """fp32 dot products of a block of packed weight rows (pointers q_rows [BLOCK_N, 1] to each row's bytes,
        s_rows/o_rows [BLOCK_N] to its scales and offsets) with one vector of length K; groups of G. BLOCK_B bytes
        of each row (several groups) a step, as [rows, groups, bytes] tiles: wide loads keep enough memory traffic
        in flight, and a group's scale and offset are loaded once."""
        HALF: tl.constexpr = G // 2
        STEP: tl.constexpr = BLOCK_B // HALF if BLOCK_B > HALF else 1  # groups a step
        byte = tl.arange(0, HALF)
        acc = tl.zeros([BLOCK_N, STEP, HALF], dtype=tl.float32)  # summed across lanes once, at the end
        for start in range(0, K // G, STEP):
            group = start + tl.arange(0, STEP)
            group_ok = group < K // G
            col = group[:, None] * G + byte[None, :]  # the low nibbles' inputs; the high ones' are HALF further
            v_low = tl.load(v_row + col, mask=group_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            v_high = tl.load(v_row + col + HALF, mask=group_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            ok = row_ok[:, None] & group_ok[None, :]
            q = tl.load(q_rows[:, :, None] + (group[:, None] * HALF + byte[None, :])[None, :, :],
                        mask=ok[:, :, None], other=0)
            scale = tl.load(s_rows[:, None] + group[None, :], mask=ok, other=0.0).to(tl.float32)[:, :, None]
            offset = tl.load(o_rows[:, None] + group[None, :], mask=ok, other=0.0).to(tl.float32)[:, :, None]
            acc += ((q & 15).to(tl.float32) * scale + offset) * v_low \
                + ((q >> 4).to(tl.float32) * scale + offset) * v_high
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def rows_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, N, K: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_B: tl.constexpr):
        row = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = rows_dot(q_ptr + n[:, None].to(tl.int64) * (K // 2), s_ptr + n * (K // G), o_ptr + n * (K // G),
                       x_ptr + row.to(tl.int64) * K, n_ok, K, G, BLOCK_N, BLOCK_B)
        tl.store(out_ptr + row.to(tl.int64) * N + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def unpack_kernel(q_ptr, s_ptr, o_ptr, out_ptr, rows, K: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):
        """One group of BLOCK_R rows: code * scale + offset in fp32, rounded to the output's dtype as `dequantize`
        rounds (by bit arithmetic everywhere: Triton's interpreter truncates in its cast; the kernel is bound by
        memory)."""
        HALF: tl.constexpr = G // 2
        row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        group = tl.program_id(1)
        ok = row < rows
        half = tl.arange(0, HALF)
        q = tl.load(q_ptr + row[:, None].to(tl.int64) * (K // 2) + group * HALF + half[None, :], mask=ok[:, None],
                    other=0).to(tl.int32)
        scale = tl.load(s_ptr + row.to(tl.int64) * (K // G) + group, mask=ok, other=0.0).to(tl.float32)[:, None]
        offset = tl.load(o_ptr + row.to(tl.int64) * (K // G) + group, mask=ok, other=0.0).to(tl.float32)[:, None]
        dtype = out_ptr.dtype.element_ty
        out = out_ptr + row[:, None].to(tl.int64) * K + group * G + half[None, :]
        tl.store(out, int4_weights(q & 15, scale, offset, dtype, True), mask=ok[:, None])
        tl.store(out + HALF, int4_weights(q >> 4, scale, offset, dtype, True), mask=ok[:, None])

    _ROWS_KERNEL, _UNPACK_KERNEL = rows_kernel, unpack_kernel
