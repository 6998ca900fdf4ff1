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
int4 kernels measured slower than the library's bf16 ones for 0.14 GB saved (docs/PERFORMANCE.md).

Kernels (Triton): `grouped_kernel`, a matmul over rows grouped by expert (`tl.dot` on tiles dequantized in
registers) for prefill (experts, and linear layers over many rows); `rows_kernel`, dot products of a few rows
(a decode step, one row per session) with many small blocks of weight rows, so that a step's few rows still spread
over the whole GPU; moe.py's single-token MoE kernels read the same packed format for decode (`rows_dot`).
Without CUDA and Triton (the CPU), the math is done by dequantizing first, which is also the reference the tests
hold the kernels to under Triton's interpreter.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from .triton_support import rounded, tl, triton

log = logging.getLogger(__name__)

GROUP = 128
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the tests)
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
    return x.is_cuda and _KERNEL is not None


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
        if _kernels_on(x) and rows.shape[0] <= DECODE_ROWS:
            out = rows_matmul(rows, self.weight_int4)
        elif _kernels_on(x):
            out = matmul(rows, self.weight_int4)
        else:
            out = F.linear(rows, self.weight_int4.dequantized())
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
        """Pairs (token, chosen expert) sorted by expert; each expert's rows in tiles; no host synchronisation, so
        it is captured in CUDA graphs."""
        tokens, top_k = index.shape
        ids = index.reshape(-1)
        order = torch.argsort(ids, stable=True).to(torch.int32)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, ids.long() + 1, torch.ones_like(ids, dtype=torch.int32))
        starts = counts.cumsum(0, dtype=torch.int32)
        # an expert is chosen at most once per token: it has at most `tokens` rows
        h = matmul(x, self.gate_up, rows=(order // top_k, order, starts), gated=self.intermediate_dim,
                   rows_per_expert=tokens)
        y = matmul(h, self.down, rows=(order, order, starts), rows_per_expert=tokens)
        y = y.view(tokens, top_k, -1) * weights.unsqueeze(-1)
        return y.float().sum(dim=1).to(x.dtype)  # as the library: each term in the model dtype, summed


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


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # source row, destination row (sorted by expert), starts [E+1]


def matmul(x: torch.Tensor, weight: Int4Weight, rows: Rows | None = None, gated: int = 0,
           rows_per_expert: int | None = None) -> torch.Tensor:
    """out[dst] = x[src] @ W[e]^T for each expert e's rows (`rows`, at most `rows_per_expert` each), or x @ W^T for
    a single weight. With `gated` (= I, the weight being [E, 2I, H] of gate and up): out = silu(gate) * up."""
    k = x.shape[-1]
    n = weight.shape[-2] // 2 if gated else weight.shape[-2]
    x = x.contiguous()
    if rows is None:
        count = x.shape[0]
        src = dst = starts = x  # placeholders, never read
        experts = 1
    else:
        src, dst, starts = rows
        count = src.shape[0]
        experts = starts.shape[0] - 1
    out = torch.empty(count, n, dtype=x.dtype, device=x.device)
    most = min(count, rows_per_expert or count)
    block_m = 16 if most <= 64 else 64
    block_n = 64
    m_blocks = -(-most // block_m)  # programs past an expert's rows return at once
    _KERNEL[(experts * m_blocks, -(-n // block_n))](
        x, src, dst, starts, weight.packed, weight.scale, weight.offset, out, count, n,
        weight.packed.stride(0) if rows is not None else 0, weight.scale.stride(0) if rows is not None else 0,
        m_blocks, K=k, G=weight.group, GATHER=rows is not None, GATED=bool(gated), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=x.dtype == torch.float32 or INTERPRETED, num_warps=4)
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


_KERNEL = _ROWS_KERNEL = rows_dot = None  # the kernels, where Triton is installed
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
    def _tile(x_ptr, src, m_ok, q_ptr, s_ptr, o_ptr, n, n_ok, K: tl.constexpr, G: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        """[BLOCK_M, BLOCK_N] = x[src] @ W[n]^T in fp32, W's tiles dequantized in registers to x's dtype (their
        products with x are exact in fp32, so DOT_FP32, for Triton's interpreter whose bf16 cast is broken, gives
        the same sums)."""
        HALF: tl.constexpr = G // 2
        half = tl.arange(0, HALF)
        dtype = x_ptr.dtype.element_ty
        x_rows = x_ptr + src[:, None].to(tl.int64) * K
        q_rows = q_ptr + n[:, None].to(tl.int64) * (K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, K // G):
            a_low = tl.load(x_rows + g * G + half[None, :], mask=m_ok[:, None], other=0.0)
            a_high = tl.load(x_rows + g * G + HALF + half[None, :], mask=m_ok[:, None], other=0.0)
            q = tl.load(q_rows + g * HALF + half[None, :], mask=n_ok[:, None], other=0)
            scale = tl.load(s_ptr + n * (K // G) + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            offset = tl.load(o_ptr + n * (K // G) + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            w_low = rounded((q & 15).to(tl.float32) * scale + offset, dtype)
            w_high = rounded((q >> 4).to(tl.float32) * scale + offset, dtype)
            if DOT_FP32:
                acc += tl.dot(a_low.to(tl.float32), tl.trans(w_low), input_precision="ieee") \
                    + tl.dot(a_high.to(tl.float32), tl.trans(w_high), input_precision="ieee")
            else:
                acc += tl.dot(a_low, tl.trans(w_low.to(dtype))) + tl.dot(a_high, tl.trans(w_high.to(dtype)))
        return acc

    @triton.jit
    def grouped_kernel(x_ptr, src_ptr, dst_ptr, starts_ptr, q_ptr, s_ptr, o_ptr, out_ptr, count, N, stride_qe,
                       stride_se, m_blocks, K: tl.constexpr, G: tl.constexpr, GATHER: tl.constexpr,
                       GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        expert = tl.program_id(0) // m_blocks
        if GATHER:
            start = tl.load(starts_ptr + expert) + (tl.program_id(0) % m_blocks) * BLOCK_M
            end = tl.load(starts_ptr + expert + 1)
        else:
            start = tl.program_id(0) * BLOCK_M
            end = count
        if start < end:
            m = start + tl.arange(0, BLOCK_M)
            m_ok = m < end
            if GATHER:
                src = tl.load(src_ptr + m, mask=m_ok, other=0)
                dst = tl.load(dst_ptr + m, mask=m_ok, other=0)
            else:
                src = m
                dst = m
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            q_ptr += expert.to(tl.int64) * stride_qe
            s_ptr += expert.to(tl.int64) * stride_se
            o_ptr += expert.to(tl.int64) * stride_se
            dtype = out_ptr.dtype.element_ty
            acc = _tile(x_ptr, src, m_ok, q_ptr, s_ptr, o_ptr, n, n_ok, K, G, BLOCK_M, BLOCK_N, DOT_FP32)
            if GATED:  # rows n of gate and n + N of up: silu(gate) * up, rounded where the library rounds
                up = _tile(x_ptr, src, m_ok, q_ptr, s_ptr, o_ptr, n + N, n_ok, K, G, BLOCK_M, BLOCK_N, DOT_FP32)
                gate = rounded(acc, dtype)
                acc = rounded(rounded(gate / (1.0 + tl.exp(-gate)), dtype) * rounded(up, dtype), dtype)
            out = out_ptr + dst[:, None].to(tl.int64) * N + n[None, :]
            tl.store(out, acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def rows_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, N, K: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_B: tl.constexpr):
        row = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = rows_dot(q_ptr + n[:, None].to(tl.int64) * (K // 2), s_ptr + n * (K // G), o_ptr + n * (K // G),
                       x_ptr + row.to(tl.int64) * K, n_ok, K, G, BLOCK_N, BLOCK_B)
        tl.store(out_ptr + row.to(tl.int64) * N + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    _KERNEL, _ROWS_KERNEL = grouped_kernel, rows_kernel
