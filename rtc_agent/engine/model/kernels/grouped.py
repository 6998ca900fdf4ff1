"""Grouped matrix products for prefill: a MoE block's experts over many positions.

Why: a turn end's prefill for 24 callers is 768 positions, 6144 (token, expert) pairs in each Thinker layer. The
library's `grouped_mm` experts path spends, around its two grouped GEMMs, a radix sort over 64-bit keys, a copy of
every pair's input row, the gate/up split, SiLU and product as three passes, the routing weights' product and an
inverse permutation with its gather: a dozen kernels and about 200 MB of memory traffic a layer beside the
weights. These kernels: a Thinker MoE layer at 768 positions 628 -> 396 us on the H200
(`python -m studies.checks.grouped --tokens 768`; docs/performance.md, "Kernels").

What:
- `route` groups the pairs by expert (a counting sort in two kernels) and counts each expert's pairs and tiles of
  BLOCK_M pairs;
- `grouped_kernel` runs one program per (tile, block of BLOCK_N outputs) on a grid of fixed size (at most
  pairs / BLOCK_M + E tiles; programs past the last tile return), so nothing waits for the host and CUDA graphs
  capture it. A program reads its pairs' input rows by index and writes silu(gate) * up (the gate_up product) or
  the product times the pair's routing weight (the down product) into the pair's own row;
- `experts` puts these together; each token's top-k rows are summed at the end.

Also a batched decode step of many rows (moe.py's `GROUPED_DECODE_ROWS`): its pairs spread over most experts, and
a tile of an expert's pairs reads that expert's weights once for all of them, where the single-token kernels read
them once per pair. Rows sitting the step out (`active`) are left out of the routes: no weights read, zeros out.

Weights are either in the model dtype in the library's layout [E, N, K] (K the inputs), or INT4 packed (int4.py's
format, dequantized in registers). Every intermediate is rounded to the model dtype where the library rounds it,
so results differ from the library's only by fp32 summation order inside dot products. Without CUDA and Triton
the callers keep the library's path; the tests run these kernels on the CPU under Triton's interpreter.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .triton_support import int4_weights, rounded, silu_times, tl, triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the tests)

ROUTE_BLOCK = 256  # pairs a program of `route`'s kernels takes

# Tiles per (K, N, gated, int4, BLOCK_M): (BLOCK_N, BLOCK_K, num_warps, num_stages), from a sweep on the H200
# (docs/performance.md); other shapes take DEFAULT_TILE. For int4 weights BLOCK_K is the group (the kernel steps a
# group at a time) and only BLOCK_N, warps and stages apply.
DEFAULT_TILE = (64, 64, 4, 3)
TILES: dict[tuple[int, int, bool, bool, int], tuple[int, int, int, int]] = {
    (2048, 768, True, False, 16): (64, 128, 4, 4),  # Thinker gate_up, one row's prefill: 164 us (default 175)
    (768, 2048, False, False, 16): (64, 128, 4, 4),  # Thinker down: 86 us (89)
    (768, 2048, False, False, 64): (128, 64, 4, 3),  # Thinker down, 24 rows' prefill: 129 us (135)
    (1024, 384, True, False, 16): (64, 128, 4, 3),  # Talker gate_up: 41 us (47)
    (384, 1024, False, False, 16): (64, 128, 4, 3),  # Talker down: 24 us (24.5)
    (768, 2048, False, True, 64): (64, 0, 4, 2),  # Thinker down, INT4, 24 rows' prefill: 137 us (150)
    (384, 1024, False, True, 64): (64, 0, 4, 2),  # Talker down, INT4, 24 rows' prefill: 41 us (47)
}


def block_m_for(pairs: int, experts: int) -> int:
    """Pairs a tile: about what an expert gets on average, 16 to 64 (a tile reads its expert's weights once)."""
    mean = pairs / experts
    return 16 if mean <= 8 else 32 if mean <= 24 else 64


@dataclass(frozen=True)
class Routes:
    """Pairs (token, k-th choice), numbered token * top_k + k, grouped by expert: at each sorted position, the pair
    (`order` [P]) and its token (`tokens` [P]); `starts` [E + 1] each expert's first sorted position, `tiles` [E + 1]
    each expert's first tile of `block_m` positions. Within an expert the pairs come in no set order (each pair's
    row is computed alone, so results do not depend on it). `complete` False: some tokens were left out (their
    pairs are in no expert's range, and `order` and `tokens` are unset past the pairs placed)."""
    order: torch.Tensor
    tokens: torch.Tensor
    starts: torch.Tensor
    tiles: torch.Tensor
    block_m: int
    complete: bool = True


def route(selected: torch.Tensor, experts: int, block_m: int | None = None,
          active: torch.Tensor | None = None) -> Routes:
    """`selected` [T, k]: each token's chosen experts (as the library's router gives them); `active` [T] (bool or
    int, on the device): tokens whose 0 leaves their pairs out. A counting sort in two kernels over blocks of pairs:
    each block's histogram added to the counts, then each pair put at its expert's next free position (PyTorch's
    radix sort of the ids and the counts around it were eight kernels and 50-70 us a Thinker layer at 768 positions
    on the H200)."""
    ids = selected.reshape(-1)
    pairs, top_k = ids.numel(), selected.shape[-1]
    block_m = block_m or block_m_for(pairs, experts)
    order, tokens = (torch.empty(pairs, dtype=torch.int32, device=ids.device) for _ in range(2))
    starts, tiles = (torch.empty(experts + 1, dtype=torch.int32, device=ids.device) for _ in range(2))
    counts = torch.zeros(2, experts, dtype=torch.int32, device=ids.device)  # pairs per expert; pairs placed so far
    grid, e_pow2 = (-(-pairs // ROUTE_BLOCK),), triton.next_power_of_2(experts)
    skip = active is not None
    flags = active if skip else ids  # (a placeholder where there are none, never read)
    _COUNT_KERNEL[grid](ids, flags, counts, pairs, TOP_K=top_k, E=experts, E_POW2=e_pow2, SKIP=skip, BLOCK=ROUTE_BLOCK)
    _PLACE_KERNEL[grid](ids, flags, counts, order, tokens, starts, tiles, pairs, TOP_K=top_k, E=experts,
                        E_POW2=e_pow2, SKIP=skip, BLOCK_M=block_m, BLOCK=ROUTE_BLOCK)
    return Routes(order, tokens, starts, tiles, block_m, complete=not skip)


def experts(x: torch.Tensor, selected: torch.Tensor, routing: torch.Tensor, gate_up, down,
            active: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE block's experts: x [T, H], the router's `selected` and `routing` weights [T, k]; `gate_up` [E, 2I, H]
    and `down` [E, H, I], each a tensor or an int4.Int4Weight. -> [T, H] in x's dtype, as the library's
    `experts(x, selected, routing)`; tokens whose `active` [T] is 0 get zeros and read no weights."""
    tokens, top_k = selected.shape
    routes = route(selected, gate_up.shape[0], active=active)
    h = matmul(x, gate_up, routes, routes.tokens, routes.order, gated=True)  # [P, I], rows in pair order
    y = matmul(h, down, routes, routes.order, routes.order, routing=routing.reshape(-1))  # [P, H], weighted
    return y.view(tokens, top_k, -1).sum(dim=1)  # (the library's sum: fp32 inside, rounded once)


def matmul(x: torch.Tensor, weight, routes: Routes, src: torch.Tensor, dst: torch.Tensor, gated: bool = False,
           routing: torch.Tensor | None = None) -> torch.Tensor:
    """out[dst[i]] = x[src[i]] @ W[e]^T for each sorted position i of expert e (`routes`). `gated` (W holding gate
    and up rows, [E, 2I, K]): out = silu(gate) * up. `routing` [P]: each out row times its pair's routing weight.
    `weight`: a tensor or an int4.Int4Weight."""
    quant = hasattr(weight, "packed")
    k = x.shape[-1]
    n = weight.shape[-2] // 2 if gated else weight.shape[-2]
    x = x.contiguous()
    w = weight.packed if quant else weight
    scale, offset = (weight.scale, weight.offset) if quant else (w, w)  # placeholders where not int4
    group = weight.group if quant else 0
    count, experts_count, block_m = src.shape[0], routes.starts.shape[0] - 1, routes.block_m
    tiles = count // block_m + experts_count  # at most; programs past the last tile return
    block_n, block_k, warps, stages = TILES.get((k, n, gated, quant, block_m), DEFAULT_TILE)
    block_k = group // 2 if quant else min(block_k, triton.next_power_of_2(k))
    out = (torch.empty if routes.complete else torch.zeros)(count, n, dtype=x.dtype, device=x.device)  # rows unset: 0
    _KERNEL[(tiles, -(-n // block_n))](
        x, src, dst, routing if routing is not None else x, routes.starts, routes.tiles, w, scale, offset, out, n,
        w.stride(0), scale.stride(0) if quant else 0, K=k, E=experts_count,
        E_POW2=triton.next_power_of_2(experts_count), G=group, GATED=gated, SCALED=routing is not None, QUANT=quant,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=x.dtype == torch.float32 or INTERPRETED,
        num_warps=warps, num_stages=stages)
    return out


_KERNEL = _COUNT_KERNEL = _PLACE_KERNEL = None  # the kernels, where Triton is installed
if triton is not None:

    @triton.jit
    def _placed(flags_ptr, pair, P, TOP_K: tl.constexpr, SKIP: tl.constexpr):
        """Which of these pairs are routed: those that exist, and with SKIP those whose token's flag is not 0."""
        ok = pair < P
        if SKIP:
            ok = ok & (tl.load(flags_ptr + pair // TOP_K, mask=ok, other=0) != 0)
        return ok

    @triton.jit
    def count_kernel(ids_ptr, flags_ptr, counts_ptr, P, TOP_K: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr,
                     SKIP: tl.constexpr, BLOCK: tl.constexpr):
        """counts[0, e] += this block's pairs of expert e."""
        pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = _placed(flags_ptr, pair, P, TOP_K, SKIP)
        ids = tl.load(ids_ptr + pair, mask=ok, other=E_POW2).to(tl.int32)  # (E_POW2: no expert's)
        e = tl.arange(0, E_POW2)
        tl.atomic_add(counts_ptr + e, tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0), mask=e < E)

    @triton.jit
    def place_kernel(ids_ptr, flags_ptr, counts_ptr, order_ptr, tokens_ptr, starts_ptr, tiles_ptr, P,
                     TOP_K: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr, SKIP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
        """Each pair of this block at its expert's start plus the pairs placed before it (counts[1], atomics:
        the order within an expert is whatever the atomics give). Block 0 also writes starts and tiles."""
        e = tl.arange(0, E_POW2)
        counts = tl.load(counts_ptr + e, mask=e < E, other=0)
        ends = tl.cumsum(counts, axis=0)
        if tl.program_id(0) == 0:
            tl.store(starts_ptr + 1 + e, ends, mask=e < E)
            tl.store(tiles_ptr + 1 + e, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0), mask=e < E)
            tl.store(starts_ptr + e, 0, mask=e == 0)
            tl.store(tiles_ptr + e, 0, mask=e == 0)
        pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = _placed(flags_ptr, pair, P, TOP_K, SKIP)
        ids = tl.load(ids_ptr + pair, mask=ok, other=0).to(tl.int32)
        start = tl.sum(tl.where(e[None, :] == ids[:, None], (ends - counts)[None, :], 0), axis=1)
        position = start + tl.atomic_add(counts_ptr + E + ids, 1, mask=ok)
        tl.store(order_ptr + position, pair, mask=ok)
        tl.store(tokens_ptr + position, pair // TOP_K, mask=ok)

    @triton.jit
    def _dot(a, w, acc, DOT_FP32: tl.constexpr):
        """acc + a [M, K] @ w [N, K]^T. DOT_FP32 (fp32 inputs, or Triton's interpreter, whose bf16 cast is broken):
        in fp32 at full precision; products of bf16 values are exact in fp32, so the sums are the same."""
        if DOT_FP32:
            return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return acc + tl.dot(a, tl.trans(w))

    @triton.jit
    def _dense(x_rows, m_ok, w_rows, up_rows, n_ok, K: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        """[BLOCK_M, BLOCK_N] products x_rows @ w_rows^T in fp32, and the up rows' in the same pass (GATED)."""
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:  # masks constant along K keep the loads vectorised
                a_ok, w_ok = m_ok[:, None], n_ok[:, None]
            else:
                k_ok = (k0 + kk)[None, :] < K
                a_ok, w_ok = m_ok[:, None] & k_ok, n_ok[:, None] & k_ok
            a = tl.load(x_rows + k0 + kk[None, :], mask=a_ok, other=0.0)
            acc = _dot(a, tl.load(w_rows + k0 + kk[None, :], mask=w_ok, other=0.0), acc, DOT_FP32)
            if GATED:
                acc_up = _dot(a, tl.load(up_rows + k0 + kk[None, :], mask=w_ok, other=0.0), acc_up, DOT_FP32)
        return acc, acc_up

    @triton.jit
    def _int4_group(a_low, a_high, q_rows, s_rows, o_rows, n_ok, acc, DOT_FP32: tl.constexpr):
        """acc + one group of packed INT4 rows (pointers to the group's bytes, scale and offset in each row) times
        the inputs' two halves `a_low` and `a_high` [BLOCK_M, G/2]."""
        dtype = a_low.dtype
        half = tl.arange(0, a_low.shape[1])
        codes = tl.load(q_rows + half[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        scale = tl.load(s_rows, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        offset = tl.load(o_rows, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        acc = _dot(a_low, int4_weights(codes & 15, scale, offset, dtype, DOT_FP32), acc, DOT_FP32)
        return _dot(a_high, int4_weights(codes >> 4, scale, offset, dtype, DOT_FP32), acc, DOT_FP32)

    @triton.jit
    def _int4(x_rows, m_ok, q_rows, s_rows, o_rows, up_q, up_s, n_ok, K: tl.constexpr, G: tl.constexpr,
              GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        """[BLOCK_M, BLOCK_N] = x_rows @ W^T in fp32 for packed INT4 rows (pointers to each row's bytes, scales and
        offsets), each group's tiles dequantized in registers to x's dtype; with GATED also the up rows' (`up_q`
        bytes and `up_s` scales further on) in the same pass, so each group's inputs are loaded once."""
        HALF: tl.constexpr = G // 2
        half = tl.arange(0, HALF)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, K // G):
            a_low = tl.load(x_rows + g * G + half[None, :], mask=m_ok[:, None], other=0.0)
            a_high = tl.load(x_rows + g * G + HALF + half[None, :], mask=m_ok[:, None], other=0.0)
            q, s, o = q_rows + g * HALF, s_rows + g, o_rows + g
            acc = _int4_group(a_low, a_high, q, s, o, n_ok, acc, DOT_FP32)
            if GATED:
                acc_up = _int4_group(a_low, a_high, q + up_q, s + up_s, o + up_s, n_ok, acc_up, DOT_FP32)
        return acc, acc_up

    @triton.jit
    def grouped_kernel(x_ptr, src_ptr, dst_ptr, routing_ptr, starts_ptr, tiles_ptr, w_ptr, s_ptr, o_ptr, out_ptr,
                       N, stride_we, stride_se, K: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr,
                       G: tl.constexpr, GATED: tl.constexpr, SCALED: tl.constexpr, QUANT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        tile = tl.program_id(0)
        e = tl.arange(0, E_POW2)  # this tile's expert: the number of experts whose tiles all come before it
        ends = tl.load(tiles_ptr + 1 + e, mask=e < E, other=2 ** 30)
        expert = tl.sum((ends <= tile).to(tl.int32), axis=0)
        expert_ok = expert < E
        expert = tl.minimum(expert, E - 1)
        start = tl.load(starts_ptr + expert) + (tile - tl.load(tiles_ptr + expert)) * BLOCK_M
        end = tl.where(expert_ok, tl.load(starts_ptr + expert + 1), start)
        if start < end:
            m = start + tl.arange(0, BLOCK_M)
            m_ok = m < end
            src = tl.load(src_ptr + m, mask=m_ok, other=0)
            dst = tl.load(dst_ptr + m, mask=m_ok, other=0)
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            dtype = out_ptr.dtype.element_ty
            x_rows = x_ptr + src[:, None].to(tl.int64) * K
            if QUANT:
                q_ptr = w_ptr + expert.to(tl.int64) * stride_we
                s_ptr += expert.to(tl.int64) * stride_se
                o_ptr += expert.to(tl.int64) * stride_se
                acc, acc_up = _int4(x_rows, m_ok, q_ptr + n[:, None].to(tl.int64) * (K // 2), s_ptr + n * (K // G),
                                    o_ptr + n * (K // G), N * (K // 2), N * (K // G), n_ok, K, G, GATED, BLOCK_M,
                                    BLOCK_N, DOT_FP32)
            else:
                w_rows = w_ptr + expert.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * K
                acc, acc_up = _dense(x_rows, m_ok, w_rows, w_rows + N * K, n_ok, K, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
                                     DOT_FP32)
            if GATED:
                acc = silu_times(acc, acc_up, dtype)
            if SCALED:  # the routing weight's product, rounded as the library's
                weight = tl.load(routing_ptr + dst, mask=m_ok, other=0.0).to(tl.float32)
                acc = rounded(rounded(acc, dtype) * weight[:, None], dtype)
            out = out_ptr + dst[:, None].to(tl.int64) * N + n[None, :]
            tl.store(out, acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])

    _KERNEL, _COUNT_KERNEL, _PLACE_KERNEL = grouped_kernel, count_kernel, place_kernel
