"""A static KV cache for one decoder stack, gpt-fast style: preallocated buffers and an integer length.

Keys and values live in `[batch, kv_heads, max_len, head_dim]` buffers, written in place. The attention layers of
transformers call `update(k, v, layer_idx)`, which is all this needs to stand in for the library's cache. Cropping
(multi-turn rollback, barge-in) is moving `length` back.

Rotary positions are not cache slots once video is in the context (TMRoPE places a video second's tokens at one
time position), so the cache also keeps `rope_delta`: the position of the next sequential token minus `length`.
"""
from __future__ import annotations

import torch


class ContextFullError(RuntimeError):
    """More positions were asked for than the cache holds."""


class StaticKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, window: int | None = None, batch: int = 1) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.window = window  # sliding-window attention: each query sees at most this many keys (itself included)
        self.length = 0  # positions holding data
        self._pending = 0  # positions being written by the forward in progress
        self.rope_delta = 0  # rotary position of slot `length` is `length + rope_delta`
        # CUDA-graph steps read where to write from a device tensor instead of `length` (see graphs.py).
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.rope_delta_tensor = torch.zeros(1, dtype=torch.long, device=device)  # `rope_delta`, for graphs
        self.graph_positions: torch.Tensor | None = None  # set while a graph-mode forward is traced
        self._key_index = torch.arange(max_len, device=device)

    @classmethod
    def for_config(cls, config, max_len: int, dtype: torch.dtype, device: torch.device, **kwargs) -> "StaticKVCache":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_len, dtype, device, **kwargs)

    def begin(self, count: int) -> None:
        if self.length + count > self.max_len:
            raise ContextFullError(f"KV cache full: {self.length} + {count} > {self.max_len} positions")
        self._pending = count

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def crop(self, length: int) -> None:
        """Forget the positions from `length` on. Crops only go back into sequential text (an answer) or to 0, so
        `rope_delta` holds, and is 0 again for an empty cache."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length
        if length == 0:
            self.set_next_position(0)

    @property
    def next_position(self) -> int:
        """Rotary position of the next sequential token."""
        return self.length + self.rope_delta

    def set_next_position(self, position: int) -> None:
        self.rope_delta = position - self.length
        self.rope_delta_tensor.fill_(self.rope_delta)

    def visible_start(self) -> int:
        """First key position the queries of the pending forward may see."""
        if self.window is None:
            return 0
        return max(0, self.length - self.window + 1)

    def graph_step(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and mask for `count` queries starting at `self.position`, with fixed shapes: keys are the
        whole buffer, masked. This is what a captured step records; `length` is advanced by the caller."""
        self.graph_positions = self.position + torch.arange(count, device=self.position.device)
        mask = self._key_index[None, :] <= self.graph_positions[:, None]
        if self.window is not None:
            mask &= self._key_index[None, :] > self.graph_positions[:, None] - self.window
        return self.graph_positions, mask[None, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.graph_positions is not None:
            self.keys[layer_idx].index_copy_(2, self.graph_positions, key)
            self.values[layer_idx].index_copy_(2, self.graph_positions, value)
            return self.keys[layer_idx], self.values[layer_idx]
        start, end = self.length, self.length + key.shape[2]
        self.keys[layer_idx][:, :, start:end] = key
        self.values[layer_idx][:, :, start:end] = value
        lo = self.visible_start()
        return self.keys[layer_idx][:, :, lo:end], self.values[layer_idx][:, :, lo:end]

    def attention_mask(self, count: int, device: torch.device) -> torch.Tensor | None:
        """Boolean mask [1, 1, count, visible] for `count` new queries (True = attend), or None when every query
        may see every visible key (a single query without a window)."""
        lo, start = self.visible_start(), self.length
        if count == 1:
            return None
        q = torch.arange(start, start + count, device=device)[:, None]
        k = torch.arange(lo, start + count, device=device)[None, :]
        allowed = k <= q
        if self.window is not None:
            allowed &= k > q - self.window
        return allowed[None, None]
