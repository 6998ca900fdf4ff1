"""The attention inputs of a graphed step in one kernel: per-head RMSNorm of q and k, the rotary embedding, and the
write of the new keys and values into the static KV cache.

Why: between its projections and the attention itself, the library's attention `forward` spends about fourteen
kernels on one layer of a decode step: q_norm and k_norm, then `apply_rotary_pos_emb` (multiply, `rotate_half`'s
negation and concatenation, multiply, add, for q and for k, each on a transposed, non-contiguous tensor), then the
cache's two `index_copy_`. A graphed step is bound by its kernel count (docs/performance.md), and these run in
every layer of the Thinker (48), the Talker (20), the code predictor (5 layers, 15 times a frame) and Code2Wav's
transformer (8, no q/k norm): about 3000 of a frame's 6400 kernels.

What: one Triton program per (position, head) loads the head's row of q or k, normalises it (sum of squares,
mean and reciprocal square root in fp32, the normalised value rounded to the input dtype, times the weight and
rounded again, as the library's RMSNorm), rotates it (`x * cos` and `rotate_half(x) * sin`, each rounded to the
input dtype, and their sum rounded), and stores q for the attention or k into its cache slot; the programs of the
key heads also copy v into its slot. The rounding points are the library's, so results differ only where the
fp32 sum of squares, summed in another order, moves a value across a rounding boundary.

Where: `install(model)` patches the attention modules' `forward`; the kernel runs only for a graph-mode forward
(the cache's slots come from a device tensor: the CUDA-graphed decode steps and padded prefills) on CUDA with
Triton present. Eager prefills, the CPU and stock `generate` call the library's forward unchanged.
`rotary_torch` is the library's math in plain PyTorch (the reference of the CPU test,
tests/offline/test_rotary.py, which runs the kernel itself under Triton's interpreter).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..kv_cache import StaticKVCache, write_rows
from . import fast_path
from .triton_support import rounded, tl, triton

# The library's attention classes in modeling_qwen3_omni_moe: the Thinker's and Talker's text stacks, the code
# predictor, Code2Wav's transformer (its q_norm and k_norm are nn.Identity). All share the forward this replaces.
CLASSES = frozenset({"Qwen3OmniMoeThinkerTextAttention", "Qwen3OmniMoeTalkerCodePredictorAttention",
                     "Qwen3OmniMoeCode2WavAttention"})


def is_attention(module: nn.Module) -> bool:
    return type(module).__name__ in CLASSES and hasattr(module, "q_proj") and hasattr(module, "head_dim")


def _supported(module: nn.Module) -> bool:
    norms = (module.q_norm, module.k_norm)
    rms = all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms)
    return (rms or all(isinstance(n, nn.Identity) for n in norms)) and module.head_dim % 2 == 0


def install(model: nn.Module, enabled: bool = True) -> int:
    """Route every attention module of `model` through `attention_forward` (see fast_path.install)."""
    return fast_path.install(model, is_attention, attention_forward, enabled, _supported)


def active(model: nn.Module) -> bool:
    """Whether graphed CUDA steps of `model` take the fused kernel (installed, enabled, Triton present)."""
    return _KERNEL is not None and fast_path.enabled(model, is_attention)


def library_rotary(model: nn.Module):
    """Within the block, every attention module of `model` runs the library's own forward."""
    return fast_path.library(model, is_attention)


Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, T, head_dim]


def attention_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: Rotary,
                      attention_mask: torch.Tensor | None, past_key_values=None, **kwargs):
    """Forward of a patched attention module: the fused kernel for graph-mode steps on CUDA, the library's
    otherwise."""
    cache = past_key_values
    if not (self._fast_path and _KERNEL is not None and hidden_states.is_cuda and isinstance(cache, StaticKVCache)
            and cache.graph_positions is not None):
        return self._library_forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    return fused_attention(self, hidden_states, position_embeddings, attention_mask, cache, rotary_triton, **kwargs)


def fused_attention(module: nn.Module, hidden_states: torch.Tensor, position_embeddings: Rotary,
                    attention_mask: torch.Tensor | None, cache: StaticKVCache, rotary: Callable[..., torch.Tensor],
                    **kwargs):
    """The library's attention forward for a graph-mode step, with `rotary` (`rotary_triton`, or `rotary_torch`)
    in place of the norms, the rotary embedding and the cache update."""
    batch, length, _ = hidden_states.shape
    q, k, v = module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
    cos, sin = position_embeddings
    norms = None if isinstance(module.q_norm, nn.Identity) else (module.q_norm, module.k_norm)
    query = rotary(q, k, v, cos, sin, norms, cache.keys[module.layer_idx], cache.values[module.layer_idx],
                   cache.graph_positions)
    keys, values = cache.graph_keys(module.layer_idx)
    interface = _attention_interface(module.config._attn_implementation)
    out, weights = interface(module, query, keys, values, attention_mask, dropout=0.0, scaling=module.scaling,
                             sliding_window=module.sliding_window, **kwargs)
    return module.o_proj(out.reshape(batch, length, -1).contiguous()), weights


def _attention_interface(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 norms: tuple[nn.Module, nn.Module] | None, keys: torch.Tensor, values: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """The library's math (q_norm/k_norm modules, `apply_rotary_pos_emb`, the cache's `index_copy_`) in plain
    PyTorch, for projections q [B, T, Hq*D], k and v [B, T, Hk*D]; returns the query [B, Hq, T, D]."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb
    batch, length, _ = q.shape
    dim = keys.shape[-1]
    query, key = q.view(batch, length, -1, dim), k.view(batch, length, -1, dim)
    if norms is not None:
        query, key = norms[0](query), norms[1](key)
    query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    slots = slots.expand(batch, length)
    write_rows(keys, slots, key)
    write_rows(values, slots, v.view(batch, length, -1, dim).transpose(1, 2))
    return query


def rotary_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  norms: tuple[nn.Module, nn.Module] | None, keys: torch.Tensor, values: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """`rotary_torch` as one kernel. keys/values [B, Hk, L, D] are written at `slots` ([T], or [B, T]: each row
    at its own positions)."""
    batch, length, _ = q.shape
    kv_heads, cache_len, dim = keys.shape[1:]
    heads = q.shape[-1] // dim
    query = torch.empty(batch, heads, length, dim, dtype=q.dtype, device=q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    slots = slots.expand(batch, length).contiguous()
    cos, sin = cos.expand(batch, length, dim).contiguous(), sin.expand(batch, length, dim).contiguous()
    if norms is None:
        q_weight = k_weight = cos  # placeholders, never read
        eps = 0.0
    else:
        q_weight, k_weight, eps = norms[0].weight, norms[1].weight, float(norms[0].variance_epsilon)
    _KERNEL[(batch * length * (heads + kv_heads),)](
        q, k, v, q_weight, k_weight, cos, sin, slots, query, keys, values, eps, length, cache_len,
        HQ=heads, HK=kv_heads, D=dim, NORM=norms is not None, num_warps=1 if dim <= 128 else 2)
    return query


_KERNEL = None  # where Triton is installed
if triton is not None:

    @triton.jit
    def _normed_rotated(row_ptr, w_ptr, cos_ptr, sin_ptr, eps, dtype: tl.constexpr, D: tl.constexpr,
                        NORM: tl.constexpr):
        """One head's row: RMSNorm (optional) then the rotary embedding, as two fp32 halves rounded to `dtype`."""
        half = tl.arange(0, D // 2)
        x1 = tl.load(row_ptr + half).to(tl.float32)
        x2 = tl.load(row_ptr + D // 2 + half).to(tl.float32)
        if NORM:
            rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * (1.0 / D) + eps)
            w1 = tl.load(w_ptr + half).to(tl.float32)
            w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
            x1 = rounded(w1 * rounded(x1 * rstd, dtype), dtype)
            x2 = rounded(w2 * rounded(x2 * rstd, dtype), dtype)
        c1 = tl.load(cos_ptr + half).to(tl.float32)
        c2 = tl.load(cos_ptr + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + half).to(tl.float32)
        s2 = tl.load(sin_ptr + D // 2 + half).to(tl.float32)
        out1 = rounded(rounded(x1 * c1, dtype) - rounded(x2 * s1, dtype), dtype)  # rotate_half: (-x2, x1)
        out2 = rounded(rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype), dtype)
        return out1, out2

    @triton.jit(do_not_specialize=["length", "cache_len"])
    def rotary_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr, query_ptr, keys_ptr,
                      values_ptr, eps, length, cache_len, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                      NORM: tl.constexpr):
        """Program (b, t, head) of B x T x (HQ + HK): a query head goes to query [B, HQ, T, D]; a key head goes to
        keys [B, HK, L, D] at slot slots[b, t], and takes its v row along to values."""
        pid = tl.program_id(0)
        head = pid % (HQ + HK)
        bt = pid // (HQ + HK)
        b = bt // length
        t = bt % length
        dtype = query_ptr.dtype.element_ty
        half = tl.arange(0, D // 2)
        cos_row, sin_row = cos_ptr + bt * D, sin_ptr + bt * D
        if head < HQ:
            out1, out2 = _normed_rotated(q_ptr + (bt * HQ + head) * D, qw_ptr, cos_row, sin_row, eps, dtype, D, NORM)
            dest = query_ptr + ((b * HQ + head) * length + t) * D
        else:
            kv = head - HQ
            out1, out2 = _normed_rotated(k_ptr + (bt * HK + kv) * D, kw_ptr, cos_row, sin_row, eps, dtype, D, NORM)
            slot = tl.load(slots_ptr + bt)
            cache_row = ((b * HK + kv) * cache_len + slot) * D
            dest = keys_ptr + cache_row
            v_row = v_ptr + (bt * HK + kv) * D
            tl.store(values_ptr + cache_row + half, tl.load(v_row + half))
            tl.store(values_ptr + cache_row + D // 2 + half, tl.load(v_row + D // 2 + half))
        tl.store(dest + half, out1.to(dtype))
        tl.store(dest + D // 2 + half, out2.to(dtype))

    _KERNEL = rotary_kernel
