"""Runs one of Qwen3-Omni's decoder stacks (Thinker, Talker, code predictor, Code2Wav transformer) over new
positions, against a `StaticKVCache`, with the library's own layer modules.

The library's `forward` methods rebuild masks, caches and position ids on every call; driving the layers
directly keeps the per-step work to the layers themselves and lets the same function serve prefill, decode and
(on the GPU) a captured CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .kv_cache import StaticKVCache


def explicit_positions(positions: np.ndarray | None, cache: StaticKVCache) -> torch.Tensor | None:
    """`positions` [3, T] as a tensor [3, 1, T], or None where they are the sequential ones the cache would give
    anyway (audio and text), which keeps those prefills on the sequential graphs."""
    if positions is None:
        return None
    start = cache.next_position
    if np.array_equal(positions, np.broadcast_to(np.arange(start, start + positions.shape[1]), positions.shape)):
        return None
    return torch.from_numpy(np.ascontiguousarray(positions))[:, None]


@dataclass(frozen=True)
class FixedStep:
    """A graph-mode step that always runs at the same positions (each of the code predictor's 15: every frame
    starts its cache over), prepared once: where it writes, its mask and its rotary tables. Inside a captured
    step these would otherwise be remade on every replay, a dozen kernels each time."""
    positions: torch.Tensor  # [batch, count] cache slots
    mask: torch.Tensor | None
    visible: int | None  # keys attended over on the CPU (None: the whole buffer)
    rotary: tuple[torch.Tensor, torch.Tensor]  # (cos, sin)

    @classmethod
    def at(cls, model: nn.Module, cache: StaticKVCache, position: int, count: int, dtype: torch.dtype) -> "FixedStep":
        """`count` queries of every row of `cache` at `position` (sequential rotary positions, no TMRoPE)."""
        slots, mask, visible = cache.fixed_step(position, count)
        rope = slots + cache.rope_delta_tensor[:, None]
        return cls(slots, mask, visible, model.rotary_emb(torch.zeros(1, dtype=dtype, device=slots.device), rope))


def run_stack(model: nn.Module, embeds: torch.Tensor, cache: StaticKVCache, mrope: bool,
              capture_layer: int | None = None, graph_mode: bool = False, positions: torch.Tensor | None = None,
              deepstack: torch.Tensor | None = None, fixed: FixedStep | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append `embeds` [batch, T, hidden] at the end of `cache` (batch 1 unless `graph_mode`: a batched step,
    each row at its own `cache.position`).

    Rotary positions are `positions` [3, batch, T] (TMRoPE: time, height, width) where given, and otherwise
    sequential from `cache.next_position`; after explicit positions the next sequential one is the last token's
    largest + 1, as in the library's `get_rope_index` (set by the caller in `graph_mode`). `deepstack` [layers,
    batch, T, hidden] holds the video tokens' deepstack features and zeros elsewhere; layer i's is added after
    each of the first layers, as the library's Thinker adds them to the video tokens (adding zeros changes
    nothing, and the dense form has fixed shapes for graphs).

    Returns the final normed hidden states [1, T, hidden] and, if `capture_layer` is given, what transformers
    reports as `hidden_states[capture_layer]` (the output of layer `capture_layer - 1`, before any deepstack
    addition). With `graph_mode` the slots start at `cache.position` (a device tensor) and shapes are fixed, for
    capture in a CUDA graph; `fixed` (graph mode only) gives that step's positions, mask and rotary tables.
    """
    count = embeds.shape[1]
    graph = graph_mode and cache is not None
    if fixed is not None:
        cache.use_fixed_step(fixed.positions, fixed.visible)
        mask, position_embeddings = fixed.mask, fixed.rotary
    else:
        if graph:  # fixed shapes, positions from device tensors: capturable as a CUDA graph
            slots, mask = cache.graph_step(count)
            rope = slots + cache.rope_delta_tensor[:, None]  # [batch, count]: each row at its own position
        else:
            rope = torch.arange(count, device=embeds.device)[None] + cache.next_position
            mask = cache.attention_mask(count, embeds.device)
            cache.begin(count)
        if positions is not None:
            rope = positions.to(embeds.device)
        elif mrope:
            rope = rope[None].expand(3, *rope.shape)
        position_embeddings = model.rotary_emb(embeds, rope)
    hidden, captured = embeds, (embeds if capture_layer == 0 else None)
    for index, layer in enumerate(model.layers):
        hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                       past_key_values=cache, position_ids=None)
        if index + 1 == capture_layer:
            captured = hidden
        if deepstack is not None and index < len(deepstack):
            hidden = hidden + deepstack[index]
    if graph:
        cache.graph_positions = None
    else:
        cache.commit()
        if positions is not None:
            cache.set_next_position(int(positions[:, 0, -1].max()) + 1)
    return model.norm(hidden), captured
