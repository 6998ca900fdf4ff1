"""Attention for a few query positions (a decode step, a short graphed prefill) over a long static KV cache.

Why: a captured decode step attends over the whole cache buffer with a mask (its shapes are fixed). The
library's SDPA call packs the query heads of a KV head into one query block, so for one position the fused kernel
runs one thread block per KV head (4 on the Thinker) walking every key in turn: on the H200 that costs about
1 us per 100 keys per layer, 4 ms per Thinker token at 8192 positions. Two batched matmuls and a softmax spread
the same work over the whole GPU.

A batched graphed prefill (8 to 32 query positions a row, padded) is the other way round: there the matmuls'
fp32 scores [rows, kv_heads, groups x positions, buffer] are the cost (a softmax, a masked fill and copies over
270 MB per layer for 8 rows: 50 of an 80 ms batched prefill on the H200), while the query heads of a KV head
packed into one query block give the fused kernel work enough. So those go to the fused SDPA with the heads packed
that way, as plain multi-head attention over the KV heads (no copy of the keys per query head) under the mask
repeated per packed head: 82 -> 43 ms for 8 rows. A prefill of one row stays on the matmuls, 3 ms faster there
(the fused kernel gets only 16 blocks of queries to spread over the GPU).

`install(model)` registers `decode_attention` with the library's attention interface for the Thinker's and the
Talker's text stacks (CUDA only); a call with more than 32 query positions goes to the library's SDPA as before,
without cuDNN's kernel (`LONG_PREFILL_BACKENDS`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "rtc_agent_decode"


SHORT_QUERIES = 32  # up to this many query positions (a decode step, a graphed prefill) are handled here
PACKED_SDPA_QUERIES = 8  # from this many on (a batched prefill), the fused SDPA over packed heads
# Longer prefills (eager ones of any length, the graphs of video seconds) leave cuDNN's fused attention out: it
# builds an execution plan for each new shape, and an eager prefill of a length not seen before spent up to 1 s on
# that (H200; ≈ 0.9 ms of host time per layer even with the plan cached). The memory-efficient kernel has no setup.
LONG_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """`query` [B, heads, T, D] against `key`/`value` [B, kv_heads, L, D] under a boolean (True = attend) or
    additive `attention_mask` broadcastable to [B, 1, T, L] (None: every query sees every key); returns
    [B, T, heads, D] as the library's SDPA does. More than `SHORT_QUERIES` positions go to the library's SDPA."""
    batch, heads, count, dim = query.shape
    if count > SHORT_QUERIES:
        with sdpa_kernel(LONG_PREFILL_BACKENDS):
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * count, dim)  # query head h reads KV head h // groups
    scale = scaling if scaling is not None else dim ** -0.5
    if count >= PACKED_SDPA_QUERIES and batch > 1 and attention_mask is not None:
        # the mask [B, 1, T, L] -> [B, 1, groups x T, L]: the same for each packed head's queries
        mask = attention_mask[:, :, None].expand(-1, -1, heads // kv_heads, -1, -1).reshape(batch, 1, -1, key.shape[2])
        out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
        # reshape, not view: SDPA's memory-efficient kernel returns a strided output (copied here)
        return out.reshape(batch, heads, count, dim).transpose(1, 2), None
    scores = (torch.matmul(grouped, key.transpose(2, 3)) * scale).view(batch, kv_heads, heads // kv_heads, count, -1)
    if attention_mask is not None:
        mask = attention_mask[:, :, None]  # [B, 1, 1, T, L]: the same for every head
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, heads // kv_heads * count, -1), value)
    return out.view(batch, heads, count, dim).transpose(1, 2), None


def text_configs(model: nn.Module) -> list:
    configs = [model.thinker.config.text_config]
    if getattr(model, "talker", None) is not None:
        configs.append(model.talker.config.text_config)
    return configs


def install(model: nn.Module, enabled: bool = True) -> None:
    """Use `decode_attention` in the Thinker's and Talker's text stacks; `enabled` False puts back what the model
    had (a model never changed stays untouched)."""
    AttentionInterface.register(NAME, decode_attention)
    for config in text_configs(model):
        if enabled and config._attn_implementation != NAME:
            config.rtc_agent_library_attention = config._attn_implementation
            config._attn_implementation = NAME
        elif not enabled and config._attn_implementation == NAME:
            config._attn_implementation = config.rtc_agent_library_attention


def active(model: nn.Module) -> bool:
    return any(config._attn_implementation == NAME for config in text_configs(model))


@contextlib.contextmanager
def library_attention(model: nn.Module) -> Iterator[None]:
    """Within the block the text stacks use the library's attention (e.g. for stock `generate`)."""
    was_active = active(model)
    install(model, enabled=False)
    try:
        yield
    finally:
        install(model, enabled=was_active)
