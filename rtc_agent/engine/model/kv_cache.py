"""A static KV cache for one decoder stack, gpt-fast style: preallocated buffers and an integer length.

Keys and values live in `[batch, kv_heads, buffer_length(max_len), head_dim]` buffers, written in place. One row is one
session slot: a slot's cache (`row`) is a view of one row of the engine's batched buffers, so a batched decode
step reads every row in place. The last position of each row is scratch: a batched step writes the rows that take
no part in it there. The attention layers of
transformers call `update(k, v, layer_idx)`, which is all this needs to stand in for the library's cache. Cropping
(multi-turn rollback, barge-in) is moving `length` back.

Rotary positions are not cache slots once video is in the context (TMRoPE places a video second's tokens at one
time position), so the cache also keeps `rope_delta`: the position of the next sequential token minus `length`.
"""
from __future__ import annotations

import torch

BUFFER_ALIGN = 64  # buffer lengths in positions: a graphed step's attention multiplies over the whole buffer, and
# matrix products whose length is not a multiple of 8 lose cuBLAS's fast kernels (docs/performance.md)


def buffer_length(max_len: int) -> int:
    """Positions of a buffer holding `max_len` usable ones and one scratch position, rounded up for cuBLAS."""
    return -(-(max_len + 1) // BUFFER_ALIGN) * BUFFER_ALIGN


class ContextFullError(RuntimeError):
    """More positions were asked for than the cache holds."""


class StaticKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, window: int | None = None, batch: int = 1,
                 buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        """`buffers`: (keys, values) per layer to use instead of new ones (a row of a batched cache)."""
        shape = (batch, kv_heads, buffer_length(max_len), head_dim)
        if buffers is None:
            buffers = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                       [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])
        self.keys, self.values = buffers
        batch = self.keys[0].shape[0]
        self.max_len = max_len  # usable positions; the buffer's last position of each row is scratch
        self.scratch = self.keys[0].shape[2] - 1
        self.window = window  # sliding-window attention: each query sees at most this many keys (itself included)
        self.length = 0  # positions holding data
        self._pending = 0  # positions being written by the forward in progress
        self.rope_delta = 0  # rotary position of slot `length` is `length + rope_delta`
        # Graph-mode steps read where to write from device tensors instead of `length` (see graphs.py): one
        # position and one rope delta per row.
        self.position = torch.zeros(batch, dtype=torch.long, device=device)
        self.rope_delta_tensor = torch.zeros(batch, dtype=torch.long, device=device)  # `rope_delta`, for graphs
        self.graph_positions: torch.Tensor | None = None  # [batch, count], set while a graph-mode forward runs
        self._visible: int | None = None  # keys a graph-mode forward attends over (None: all)
        # Set while a bounded step runs (and is captured): it attends over the first `key_bound` keys only
        self.key_bound: int | None = None
        self._key_index = torch.arange(self.scratch + 1, device=device)

    def row(self, index: int) -> "StaticKVCache":
        """The cache of one row (a session slot): views of this cache's buffers, with a length of its own."""
        keys = [k[index:index + 1] for k in self.keys]
        values = [v[index:index + 1] for v in self.values]
        return StaticKVCache(len(keys), 0, 0, self.max_len, keys[0].dtype, keys[0].device, self.window,
                             buffers=(keys, values))

    def batch_view(self, rows: int) -> "StaticKVCache":
        """The first `rows` rows as one cache (a batched step over them); its positions are set per step."""
        keys, values = [k[:rows] for k in self.keys], [v[:rows] for v in self.values]
        return StaticKVCache(len(keys), 0, 0, self.max_len, keys[0].dtype, keys[0].device, self.window,
                             buffers=(keys, values))

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
        """Positions [batch, count] and mask [batch, 1, count, keys] for `count` queries per row starting at the
        row's `self.position` (at most the scratch position), with fixed shapes: keys are the whole buffer,
        masked. This is what a captured step records; `length` is advanced by the caller. With `key_bound` set,
        keys are the first `key_bound` positions only: a step for rows whose queries all lie below it (their
        writes may still go to the scratch position, which no query of theirs sees)."""
        # Positions past the buffer (a padded prefill's padding near the end, a row that sits a prefill out at
        # the scratch position) all land on the scratch position.
        self.graph_positions = (self.position[:, None] + torch.arange(count, device=self.position.device)).clamp_(
            max=self.scratch)
        keys = self._key_index[:self.key_bound]
        self._visible = self.key_bound
        if not self.position.is_cuda:  # not captured: attend over the keys up to the furthest row's query only,
            live = self.graph_positions[self.graph_positions < self.scratch]  # as an eager forward does (same
            self._visible = int(live.max()) + 1 if live.numel() else len(keys)  # arithmetic)
            keys = keys[:self._visible]
        queries = self.graph_positions[:, :, None]
        mask = keys <= queries
        if self.window is not None:
            mask &= keys > queries - self.window
        if not self.position.is_cuda and count == 1 and bool(mask.all()):
            return self.graph_positions, None
        return self.graph_positions, mask[:, None]

    def fixed_step(self, position: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
        """`graph_step` for `count` queries of every row at `position`, made once for a step that always runs
        there (the code predictor's): (positions, mask, visible keys), for `use_fixed_step`."""
        self.position.fill_(position)
        positions, mask = self.graph_step(count)
        self.graph_positions = None
        return positions.clone(), mask, self._visible

    def use_fixed_step(self, positions: torch.Tensor, visible: int | None) -> None:
        """The forward that follows writes at `positions` and attends over `visible` keys (from `fixed_step`)."""
        self.graph_positions, self._visible = positions, visible

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` [batch, kv_heads, count, dim] at each row's `graph_positions`."""
        write_rows(self.keys[layer_idx], self.graph_positions, key)
        write_rows(self.values[layer_idx], self.graph_positions, value)

    def graph_keys(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a graph-mode forward attends over (its mask's width)."""
        end = self._visible
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.graph_positions is not None:
            self.write(layer_idx, key, value)
            return self.graph_keys(layer_idx)
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


def write_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """buffer [B, H, L, D] at positions `slots` [B, T] (one list per row) gets `rows` [B, H, T, D]."""
    batch = torch.arange(buffer.shape[0], device=buffer.device)[:, None]
    buffer[batch, :, slots] = rows.transpose(1, 2).to(buffer.dtype)
