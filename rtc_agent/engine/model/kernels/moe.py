"""A single-token MoE path for decode: the Thinker's and the Talker's sparse MoE blocks on one position.

Why: for one token the library's default experts path (`grouped_mm`) spends a dozen small kernels per layer on
bookkeeping (sort, histc, cumsum, gathers, an inverse permutation) around two grouped GEMMs built for many tokens
per expert. A decode step is a few hundred such kernels; even captured in a CUDA graph each costs microseconds,
and the Thinker's 48 layers and the Talker's 20 run 10-50x their memory floor. Measured on the H200 in one CUDA
graph: 111 -> 36 us per Thinker block, 112 -> 21 us per Talker block (docs/performance.md).

What: three kernels per block, no gather copy, no host synchronisation (so it is captured in CUDA graphs):

1. the router's logits by the library's own `F.linear` call, so they are bit-identical to the library's;
2. gate_up (Triton): one program per (chosen expert, block of intermediate rows). It redoes the router's softmax,
   top-k (ties to the lower expert index, as `torch.topk` gathers them) and renormalisation from the logits,
   then reads that expert's gate and up rows by index and writes silu(gate) * up. The Talker's shared expert is
   one more program row of the same kernel;
3. down (Triton): one program per block of output rows runs over the chosen experts, scales each by its routing
   weight and sums them in fp32; for the Talker it adds sigmoid(x . shared_gate) * shared expert.

Every intermediate is rounded to the model dtype where the library rounds it (matmul outputs, the activation, the
product, the routing-weight scale, the shared-expert gate), so results differ from the library only by fp32
summation order inside dot products: most elements are bit-identical, the rest one bf16 step away.

Where: `install(model)` patches the MoE blocks' `forward`; on CUDA with Triton present, this path is taken for one
position per row (a decode step, one row per session) below `GROUPED_DECODE_ROWS` rows (the Talker's blocks: 24).
More positions (prefill), and decode steps of more rows, take the library's router and grouped.py's experts: from
about 16 rows a step's pairs spread over most experts, and grouped.py reads each chosen expert's weights once for
all its pairs where these kernels read them once per pair. The CPU calls the library's forward unchanged. With
INT4 experts (int4.py) the same kernels read the packed weights (`QUANT`).
`experts_torch` is the experts' math in plain PyTorch (gather + bmm), a reference for the CPU test; the Triton
kernels themselves are tested on the CPU under Triton's interpreter (tests/offline/test_moe.py).
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import fast_path, grouped
from .int4 import Int4Experts, rows_dot
from .triton_support import rounded, silu_times, tl, triton

# Tile sizes per (hidden, intermediate, top_k, int4): from a sweep on the H200 (docs/performance.md); others use
# DEFAULT. Values: (gate_up BLOCK_N, BLOCK_K, num_warps), (down BLOCK_N, BLOCK_K, num_warps); for int4 weights
# BLOCK_K counts bytes of packed weights (two weights each).
DEFAULT_TILES = ((8, 256, 4), (4, 256, 4))
TILES: dict[tuple[int, int, int, bool], tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    (2048, 768, 8, False): ((8, 256, 4), (4, 256, 4)),  # Thinker: 35.7 µs per block in a graph (library 111 µs)
    (1024, 384, 6, False): ((4, 256, 2), (2, 512, 4)),  # Talker, shared expert included: 20.9 µs (library 112 µs)
    (2048, 768, 8, True): ((16, 256, 4), (4, 512, 4)),  # Thinker, int4: 36.8 µs (one row; the best for 8 rows too)
    (1024, 384, 6, True): ((8, 512, 4), (4, 256, 4)),  # Talker, int4: 22.4 µs (one row)
}


def _is_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return hasattr(module, "gate") and (hasattr(experts, "gate_up_proj") or isinstance(experts, Int4Experts))


def install(model: nn.Module, enabled: bool = True) -> int:
    """Route every sparse MoE block of `model` through `block_forward` (see fast_path.install)."""
    return fast_path.install(model, _is_moe_block, block_forward, enabled, _supported)


def active(model: nn.Module) -> bool:
    """Whether one-position CUDA decode of `model` takes the fast path (installed, enabled, Triton present)."""
    return _KERNELS is not None and fast_path.enabled(model, _is_moe_block)


def library_path(model: nn.Module):
    """Within the block, every MoE block of `model` runs the library's own path (e.g. for stock `generate`)."""
    return fast_path.library(model, _is_moe_block)


def _supported(block: nn.Module) -> bool:
    experts = block.experts
    act = getattr(experts, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        silu = silu and type(shared.act_fn) is type(act) and shared.gate_proj.weight.is_contiguous() \
            and shared.up_proj.weight.is_contiguous() and shared.down_proj.weight.is_contiguous()
    if isinstance(experts, Int4Experts):  # packed by int4.quantize: contiguous, K multiple of 128
        return silu and experts.num_experts & (experts.num_experts - 1) == 0
    experts_count = experts.gate_up_proj.shape[0]
    return silu and getattr(experts, "has_gate", True) and not getattr(experts, "has_bias", False) \
        and not getattr(experts, "is_transposed", False) and not getattr(experts, "has_post_expert_norm", False) \
        and experts.gate_up_proj.is_contiguous() and experts.down_proj.is_contiguous() \
        and experts_count & (experts_count - 1) == 0


# A batched decode step (one position a row) of this many rows or more takes grouped.py's experts; a block with a
# shared expert (the Talker's, whose shared expert and router the grouped path runs as the library's modules) from
# GROUPED_DECODE_ROWS_SHARED. A block in a CUDA graph on the H200, µs, fused / grouped, every row taking part (every
# other one): Thinker 8 rows 149 / 159 (97 / 118), 16 rows 254 / 226 (172 / 165), 24 rows 357 / 267 (245 / 206);
# INT4 16 rows 324 / 208, 24 rows 474 / 245; Talker 16 rows 117 / 115 (86 / 109), 24 rows 166 / 128 (121 / 121)
# (`python -m studies.checks.grouped --int4 --decode 8 16 24`; docs/performance.md, "Kernels").
GROUPED_DECODE_ROWS = 16
GROUPED_DECODE_ROWS_SHARED = 24


def block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Forward of a patched MoE block on CUDA: the fused path for one position per row (a decode step, batched over
    sessions) below GROUPED_DECODE_ROWS rows (the Talker's: GROUPED_DECODE_ROWS_SHARED), the library's router and
    grouped.py's experts for more rows or more positions (prefill); the library's forward elsewhere."""
    if not (self._fast_path and hidden_states.is_cuda and _KERNELS is not None):
        return self._library_forward(hidden_states)
    grouped_from = GROUPED_DECODE_ROWS_SHARED if hasattr(self, "shared_expert") else GROUPED_DECODE_ROWS
    if hidden_states.shape[1] == 1 and hidden_states.shape[0] < grouped_from:
        return fused_forward(self, hidden_states)
    return grouped_forward(self, hidden_states)


def grouped_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The library's router and grouped.py's experts, leaving out a decode step's rows that sit it out."""
    return moe_forward(block, hidden_states, experts_grouped, active=_active_rows(hidden_states))


ROUTE_IN_KERNEL = True  # False: the library's router module (softmax, topk, ... as separate kernels) decides
_ACTIVE: torch.Tensor | None = None  # the batched decode step's rows that take part (`skipping_rows`)


@contextlib.contextmanager
def skipping_rows(active: torch.Tensor) -> Iterator[None]:
    """Within it, patched MoE blocks leave out the rows whose `active` [rows] (bool or int, on the device; the same
    tensor at every replay of a graph captured inside) is 0: a row that sits a batched decode step out reads no
    expert weights and gets zeros (in the fused path and in grouped.py's). Why: with callers in slots 0-23 and
    three of them answering, a step's experts were read for 24 rows; the expert weights are most of a decode step's
    memory traffic."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, active
    try:
        yield
    finally:
        _ACTIVE = previous


def _active_rows(hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The flags of `skipping_rows` where they apply to this input: a decode step (one position) of their rows."""
    batch, length, _ = hidden_states.shape
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.shape[0] == batch and length == 1 else None


def fused_forward(block: nn.Module, hidden_states: torch.Tensor, route_in_kernel: bool | None = None) -> torch.Tensor:
    """The whole block in three kernels: the router's logits by the library's own `F.linear` call (so they are
    bit-identical and the same experts win, near-ties included), then gate_up (softmax, top-k and renormalisation
    folded in, plus the shared expert's gate and up where there is one), then down (weighted sum, shared expert
    and its sigmoid gate)."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    shared = {"shared": getattr(block, "shared_expert", None),
              "shared_gate": getattr(block, "shared_expert_gate", None)}
    active = _active_rows(hidden_states)
    if ROUTE_IN_KERNEL if route_in_kernel is None else route_in_kernel:
        logits = F.linear(x, block.gate.weight)
        out = _launch(block.experts, x, block.gate.top_k, logits=logits, norm=block.gate.norm_topk_prob,
                      active=active, **shared)
    else:
        _, weights, selected = block.gate(x)
        out = _launch(block.experts, x, block.gate.top_k, selected=selected, weights=weights, active=active,
                      **shared)
    return out.view(batch, length, hidden)


def moe_forward(block: nn.Module, hidden_states: torch.Tensor, experts_fn,
                active: torch.Tensor | None = None) -> torch.Tensor:
    """The library block's forward (Thinker's, or Talker's with its shared expert) with `experts_fn` in place of
    `block.experts(...)`: the library's router, then `experts_fn(experts, x, selected, weights)`. `active` [tokens]
    (`skipping_rows`' flags): passed on as `experts_fn(..., active=active)`, and the tokens whose 0 get zeros."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    shared = block.shared_expert(x) if hasattr(block, "shared_expert") else None
    _, routing_weights, selected = block.gate(x)
    if active is None:
        out = experts_fn(block.experts, x, selected, routing_weights)
    else:
        out = experts_fn(block.experts, x, selected, routing_weights, active=active)
    if shared is not None:
        out = out + F.sigmoid(block.shared_expert_gate(x)) * shared
        if active is not None:  # (the routed experts' part is zeros there already)
            out = torch.where(active.view(-1, 1) != 0, out, 0)
    return out.reshape(batch, length, hidden)


def experts_torch(experts: nn.Module, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch reference of the same math: gather the chosen experts' weights, two batched matmuls."""
    tokens, top_k = selected.shape
    ids = selected.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0)  # [T*k, H]
    gate_up = torch.bmm(experts.gate_up_proj.index_select(0, ids), xs.unsqueeze(-1)).squeeze(-1)  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    h = experts.act_fn(gate) * up
    y = torch.bmm(experts.down_proj.index_select(0, ids), h.unsqueeze(-1)).squeeze(-1)  # [T*k, H]
    y = y * weights.reshape(-1, 1)
    return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def experts_grouped(experts: nn.Module, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor,
                    active: torch.Tensor | None = None) -> torch.Tensor:
    """grouped.py's experts for many positions, on the library's weights or INT4 ones."""
    quant = isinstance(experts, Int4Experts)
    gate_up, down = (experts.gate_up, experts.down) if quant else (experts.gate_up_proj, experts.down_proj)
    return grouped.experts(x, selected, weights, gate_up, down, active)


def experts_triton(experts: nn.Module, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor,
                   active: torch.Tensor | None = None) -> torch.Tensor:
    """The two Triton kernels on routing given from outside (the library's router). x [T, H]; selected, weights
    [T, k]; `active` [T]: tokens whose 0 leaves them out (zeros out, no weights read), as `skipping_rows`."""
    return _launch(experts, x, selected.shape[1], selected=selected, weights=weights, active=active)


def _launch(experts, x, top_k, logits=None, norm=True, selected=None, weights=None, shared=None, shared_gate=None,
            active=None):
    tokens, hidden = x.shape
    quant = isinstance(experts, Int4Experts)
    if quant:
        count, inter = experts.num_experts, experts.intermediate_dim
        gate_up, down = experts.gate_up.packed, experts.down.packed
        scales = (experts.gate_up.scale, experts.gate_up.offset, experts.down.scale, experts.down.offset)
        groups = (experts.gate_up.group, experts.down.group)
    else:
        count, _, inter = experts.down_proj.shape
        gate_up, down = experts.gate_up_proj, experts.down_proj
        scales = (gate_up,) * 4  # placeholders, never read
        groups = (0, 0)
    (bn1, bk1, w1), (bn2, bk2, w2) = TILES.get((hidden, inter, top_k, quant), DEFAULT_TILES)
    x = x.contiguous()
    pairs = tokens * top_k
    if logits is not None:  # routed inside the gate_up kernel, which leaves ids and weights here for down
        ids = torch.empty(pairs, dtype=torch.int32, device=x.device)
        routing = torch.empty(pairs, dtype=x.dtype, device=x.device)
    else:
        ids, routing = selected.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    if shared is not None:
        s_gate, s_up, s_down = shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight
        s_router, s_inter = shared_gate.weight, s_gate.shape[0]
    else:  # placeholders, never read
        s_gate = s_up = s_down = s_router = x
        s_inter = inter
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    h_shared = torch.empty(tokens, s_inter, dtype=x.dtype, device=x.device) if shared is not None else h
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    skip = active is not None
    _KERNELS.gate_up[(pairs + (tokens if shared is not None else 0), -(-max(inter, s_inter) // bn1))](
        x, gate_up, scales[0], scales[1], s_gate, s_up, logits if logits is not None else x, ids, routing, h,
        h_shared, active if skip else x, pairs, gate_up.stride(0), scales[0].stride(0), H=hidden, I=inter,
        IS=s_inter, E=count, TOP_K=top_k, ROUTE=logits is not None, NORM=bool(norm), SHARED=shared is not None,
        QUANT=quant, SKIP=skip, G_UP=groups[0], BLOCK_N=bn1, BLOCK_K=bk1, num_warps=w1)
    _KERNELS.down[(tokens, -(-hidden // bn2))](
        h, h_shared, down, scales[2], scales[3], s_down, s_router, x, ids, routing, out, active if skip else x,
        down.stride(0), scales[2].stride(0), H=hidden, I=inter, IS=s_inter, TOP_K=top_k, SHARED=shared is not None,
        QUANT=quant, SKIP=skip, G_DOWN=groups[1], BLOCK_N=bn2, BLOCK_K=bk2, num_warps=w2)
    return out


_KERNELS = None  # the two kernels, where Triton is installed
if triton is not None:

    @triton.jit
    def _route(logits_row, slot, E: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr):
        """The library router's choice for `slot` from one token's logits: softmax in fp32, top-k (ties to the
        lower expert index, as torch.topk gathers them), renormalised. Returns (expert, weight in fp32)."""
        offs = tl.arange(0, E)
        logits = tl.load(logits_row + offs).to(tl.float32)
        e = tl.exp(logits - tl.max(logits, axis=0))
        p = e / tl.sum(e, axis=0)
        total = tl.sum(p, axis=0) * 0.0
        expert = tl.argmax(p, axis=0) * 0
        weight = total
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            index = tl.argmax(p, axis=0, tie_break_left=True)
            total += best
            expert = tl.where(slot == j, index, expert)
            weight = tl.where(slot == j, best, weight)
            p = tl.where(offs == index, -1.0, p)
        if NORM:
            weight = weight / total
        return expert, weight

    @triton.jit
    def _gate_up_rows(x_row, gate_rows, up_rows, rows, row_ok, dtype: tl.constexpr, H: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """silu(gate) * up for a block of rows of full-precision weights."""
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, H, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < H
            xv = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            ok = row_ok[:, None] & col_ok[None, :]
            wg = tl.load(gate_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            wu = tl.load(up_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            acc_gate += tl.sum(wg * xv[None, :], axis=1)
            acc_up += tl.sum(wu * xv[None, :], axis=1)
        return silu_times(acc_gate, acc_up, dtype)

    @triton.jit
    def _rows_dot(w_rows, v_row, row_ok, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 dot products of a block of weight rows (length N) with one vector."""
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < N
            v = tl.load(v_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * v[None, :], axis=1)
        return acc

    @triton.jit
    def _takes_part(active_ptr, token, SKIP: tl.constexpr):
        """Whether `token` takes part in the step (`skipping_rows`): its active flag, or always without one."""
        if SKIP:
            return tl.load(active_ptr + token) != 0
        return token >= 0

    @triton.jit
    def gate_up_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, s_gate_ptr, s_up_ptr, logits_ptr, ids_ptr, routing_ptr,
                       h_ptr, hs_ptr, active_ptr, pairs, stride_we, stride_se, H: tl.constexpr, I: tl.constexpr,
                       IS: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, ROUTE: tl.constexpr,
                       NORM: tl.constexpr, SHARED: tl.constexpr, QUANT: tl.constexpr, SKIP: tl.constexpr,
                       G_UP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)  # token * TOP_K + slot for routed experts; pairs + token for the shared expert
        block = tl.program_id(1)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        dtype = h_ptr.dtype.element_ty
        if pair < pairs:
            token = pair // TOP_K
            if ROUTE:
                expert, weight = _route(logits_ptr + token.to(tl.int64) * E, pair % TOP_K, E, TOP_K, NORM)
                if block == 0:
                    tl.store(ids_ptr + pair, expert.to(tl.int32))
                    tl.store(routing_ptr + pair, rounded(weight, dtype).to(dtype))
            else:
                expert = tl.load(ids_ptr + pair)
            if (block * BLOCK_N < I) & _takes_part(active_ptr, token, SKIP):
                row_ok = rows < I
                x_row = x_ptr + token.to(tl.int64) * H
                if QUANT:  # int4.py's packed rows: H/2 bytes and H/128 scales and offsets a row
                    q_rows = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None].to(tl.int64) * (H // 2)
                    s_rows = scale_ptr + expert.to(tl.int64) * stride_se + rows * (H // G_UP)
                    o_rows = offset_ptr + expert.to(tl.int64) * stride_se + rows * (H // G_UP)
                    acc_gate = rows_dot(q_rows, s_rows, o_rows, x_row, row_ok, H, G_UP, BLOCK_N, BLOCK_K)
                    acc_up = rows_dot(q_rows + I * (H // 2), s_rows + I * (H // G_UP), o_rows + I * (H // G_UP),
                                      x_row, row_ok, H, G_UP, BLOCK_N, BLOCK_K)
                    h = silu_times(acc_gate, acc_up, dtype)
                else:
                    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None].to(tl.int64) * H
                    h = _gate_up_rows(x_row, gate_rows, gate_rows + I * H, rows, row_ok, dtype, H, BLOCK_N, BLOCK_K)
                tl.store(h_ptr + pair.to(tl.int64) * I + rows, h.to(dtype), mask=row_ok)
        elif SHARED:
            token = pair - pairs
            if (block * BLOCK_N < IS) & _takes_part(active_ptr, token, SKIP):
                row_ok = rows < IS
                offset = rows[:, None].to(tl.int64) * H
                h = _gate_up_rows(x_ptr + token.to(tl.int64) * H, s_gate_ptr + offset, s_up_ptr + offset, rows,
                                  row_ok, dtype, H, BLOCK_N, BLOCK_K)
                tl.store(hs_ptr + token.to(tl.int64) * IS + rows, h.to(dtype), mask=row_ok)

    @triton.jit
    def down_kernel(h_ptr, hs_ptr, w_ptr, scale_ptr, offset_ptr, s_down_ptr, s_router_ptr, x_ptr, ids_ptr, routing_ptr,
                    out_ptr, active_ptr, stride_we, stride_se, H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr,
                    TOP_K: tl.constexpr, SHARED: tl.constexpr, QUANT: tl.constexpr, SKIP: tl.constexpr,
                    G_DOWN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        token = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < H
        dtype = out_ptr.dtype.element_ty
        if _takes_part(active_ptr, token, SKIP):
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for slot in tl.static_range(TOP_K):  # sum over the experts in fp32, each term rounded as the library's
                pair = token * TOP_K + slot
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                scale = tl.load(routing_ptr + pair).to(tl.float32)
                h_row = h_ptr + pair.to(tl.int64) * I
                if QUANT:
                    acc = rows_dot(w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * (I // 2),
                                   scale_ptr + expert * stride_se + rows * (I // G_DOWN),
                                   offset_ptr + expert * stride_se + rows * (I // G_DOWN), h_row, row_ok, I, G_DOWN,
                                   BLOCK_N, BLOCK_K)
                else:
                    acc = _rows_dot(w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * I, h_row, row_ok, I,
                                    BLOCK_N, BLOCK_K)
                total += rounded(rounded(acc, dtype) * scale, dtype)
            result = rounded(total, dtype)
            if SHARED:  # out = routed + sigmoid(x . shared_gate) * shared_down(h_shared), as the Talker's block does
                acc = _rows_dot(s_down_ptr + rows[:, None].to(tl.int64) * IS, hs_ptr + token.to(tl.int64) * IS,
                                row_ok, IS, BLOCK_N, BLOCK_K)
                gate_dot = tl.zeros([BLOCK_K], dtype=tl.float32)
                for start in range(0, H, BLOCK_K):
                    cols = start + tl.arange(0, BLOCK_K)
                    col_ok = cols < H
                    xv = tl.load(x_ptr + token.to(tl.int64) * H + cols, mask=col_ok, other=0.0).to(tl.float32)
                    gv = tl.load(s_router_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                    gate_dot += xv * gv
                gate = rounded(tl.sum(gate_dot, axis=0), dtype)
                sigmoid = rounded(1.0 / (1.0 + tl.exp(-gate)), dtype)
                result = rounded(result + rounded(sigmoid * rounded(acc, dtype), dtype), dtype)
            tl.store(out_ptr + token.to(tl.int64) * H + rows, result.to(dtype), mask=row_ok)
        else:  # a row sitting the step out: zeros, no weights read
            tl.store(out_ptr + token.to(tl.int64) * H + rows, tl.zeros([BLOCK_N], dtype=dtype), mask=row_ok)

    _KERNELS = types.SimpleNamespace(gate_up=gate_up_kernel, down=down_kernel)
