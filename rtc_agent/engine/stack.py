"""Runs one of Qwen3-Omni's decoder stacks (Thinker, Talker, code predictor, Code2Wav transformer) over new
positions, against a `StaticKVCache`, with the library's own layer modules.

The library's `forward` methods rebuild masks, caches and position ids on every call; driving the layers
directly keeps the per-step work to the layers themselves and lets the same function serve prefill, decode and
(on the GPU) a captured CUDA graph.
"""
from __future__ import annotations

import torch
from torch import nn

from .kv_cache import StaticKVCache


def run_stack(model: nn.Module, embeds: torch.Tensor, cache: StaticKVCache, mrope: bool,
              capture_layer: int | None = None, graph_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append `embeds` [1, T, hidden] at the end of `cache`; positions are sequential (audio and text only).

    Returns the final normed hidden states [1, T, hidden] and, if `capture_layer` is given, the hidden states
    entering that layer (what transformers reports as `hidden_states[capture_layer]`). With `graph_mode` the
    positions start at `cache.position` (a device tensor) and shapes are fixed, for capture in a CUDA graph.
    """
    count = embeds.shape[1]
    graph = graph_mode and cache is not None
    if graph:  # fixed shapes, positions from a device tensor: capturable as a CUDA graph
        positions, mask = cache.graph_step(count)
        positions = positions[None]
    else:
        positions = torch.arange(cache.length, cache.length + count, device=embeds.device)[None]
        mask = cache.attention_mask(count, embeds.device)
        cache.begin(count)
    if mrope:
        positions = positions[None].expand(3, -1, -1)
    position_embeddings = model.rotary_emb(embeds, positions)
    hidden, captured = embeds, None
    for index, layer in enumerate(model.layers):
        if index == capture_layer:
            captured = hidden
        hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                       past_key_values=cache, position_ids=None)
    if graph:
        cache.graph_positions = None
    else:
        cache.commit()
    if capture_layer is not None and capture_layer >= len(model.layers):
        captured = hidden
    return model.norm(hidden), captured
