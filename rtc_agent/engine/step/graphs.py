"""CUDA-graphed decode steps: each step's hundreds of small kernels replayed as one graph launch.

A captured step reads its inputs from static tensors and writes its outputs to static tensors; the KV cache
position comes from `StaticKVCache.position`, set before each replay. A graph is bound to the cache buffers it
was captured with: the engine captures them once at start-up, per session slot (prefills) or per batch size
(decode steps over the slots' rows), and never again.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..model.kv_cache import StaticKVCache


def batch_sizes(slots: int) -> list[int]:
    """The batch sizes steps are captured for: powers of two below `slots`, and `slots` itself."""
    sizes, size = [], 1
    while size < slots:
        sizes.append(size)
        size *= 2
    return sizes + [slots]


def rows_for(highest_row: int, slots: int) -> int:
    """The smallest captured batch that covers rows 0..`highest_row`."""
    return next(size for size in batch_sizes(slots) if size > highest_row)


class CapturedStep:
    """`fn(*inputs)` captured once; calling the object copies new inputs in and replays. With `graph` False (the
    CPU) it calls `fn` directly: the same step runs eagerly, so CPU tests run the code the GPU graphs run."""

    def __init__(self, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], *example_inputs: torch.Tensor,
                 stream: torch.cuda.Stream | None = None, graph: bool = True, pool: Any = None):
        """`stream`: capture on this stream (by default the library's one capture stream). Graphs that replay at
        the same time on different streams must be captured on different streams: cuBLAS keeps one workspace per
        stream, and two graphs captured on one stream would share it. `pool` (`torch.cuda.graph_pool_handle()`):
        share memory with the other graphs captured into it, for graphs that never run at the same time and whose
        outputs are used before another of them replays (they may then overwrite each other's outputs)."""
        self.fn = fn
        self.graph = None
        if not graph:
            return
        self.inputs = [x.clone() for x in example_inputs]
        side = stream or _warmup_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up runs (library workspaces, lazy init) stay out of the graph
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, pool=pool):
            self.outputs = fn(*self.inputs)
        # A graph is uploaded to the device on its first replay (milliseconds for a big one): do it now, not in a
        # caller's first answer. Every step here only writes buffers that are empty or scratch at capture time.
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor):
        if self.graph is None:
            return self.fn(*inputs)
        for static, value in zip(self.inputs, inputs):
            static.copy_(value)
        self.graph.replay()
        return self.outputs


def _warmup_stream() -> torch.cuda.Stream:
    """One stream for every capture's warm-up runs. (A new `torch.cuda.Stream()` per capture would cycle through
    torch's pool of 32 streams, hundreds of times over with many session slots, and land on streams in use.)"""
    global _WARMUP_STREAM
    if _WARMUP_STREAM is None:
        _WARMUP_STREAM = torch.cuda.Stream()
    return _WARMUP_STREAM


_WARMUP_STREAM: torch.cuda.Stream | None = None


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued before: a copy from pageable memory would
    synchronise the stream (the host then idles until the GPU is done, and the GPU until the host queues more);
    through pinned memory it is queued like a kernel."""
    if device.type != "cuda" or x.device.type == "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device value brought to the host without waiting for the work queued after it: `start` queues a copy
    into pinned memory on the current stream and marks it with an event; `get` waits for that event alone."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def start(self, value: torch.Tensor) -> None:
        """Queue the copy of `value` (the shape of `host`, or its first rows)."""
        self.host[:value.shape[0]].copy_(value, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class DeviceCopy:
    """Small host values sent to the device without waiting for the work queued before them (a plain copy from
    pageable memory would synchronise the stream): fill `host` (pinned), then `send` queues the copy."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self.device = torch.zeros(shape, dtype=dtype, device=device)
        self.event = torch.cuda.Event() if cuda else None

    def send(self) -> torch.Tensor:
        self.device.copy_(self.host, non_blocking=self.event is not None)
        if self.event is not None:  # `host` may be rewritten only once the copy has read it (`wait_sent`)
            self.event.record()
        return self.device

    def wait_sent(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def begin_rows(view: StaticKVCache, caches: list[StaticKVCache | None], staging: DeviceCopy,
               counts: list[int] | None = None) -> torch.Tensor:
    """Before a batched step over `view` (the first len(caches) rows of a batched cache): each row's own cache
    (None: the row sits the step out and writes to the scratch position) takes one position (`counts[i]` for a
    prefill), and `view`'s positions and rope deltas are set on the device without waiting for the work queued
    before. `staging`: (3, rows) of long. Returns the rows' active mask, on the device; `commit_rows` after the
    step."""
    count = len(caches)
    staging.wait_sent()
    host = staging.host
    host[0], host[1], host[2] = view.scratch, 0, 0
    for i, cache in enumerate(caches):
        if cache is not None:
            cache.begin(counts[i] if counts is not None else 1)
            host[0, i], host[1, i], host[2, i] = cache.length, cache.rope_delta, 1
    inputs = staging.send()
    view.position.copy_(inputs[0, :count])
    view.rope_delta_tensor.copy_(inputs[1, :count])
    return inputs[2, :count].bool()


def commit_rows(caches: list[StaticKVCache | None]) -> None:
    for cache in caches:
        if cache is not None:
            cache.commit()


PREFILL_GRAPH_POSITIONS = 32  # one graphed prefill covers a 1 s audio chunk (13 tokens) plus turn markers
KEY_BOUNDS = (1024, 2048, 4096)  # the keys a batched prefill's steps attend over, besides the whole buffer
VIDEO_PREFILL_POSITIONS = 256  # one graphed prefill at TMRoPE positions: a 1 s chunk with a second or two of video


def short_prefill_fits(cache: StaticKVCache, count: int) -> bool:
    """Whether `count` sequential positions at the end of `cache` make a short prefill, which the worker batches
    across calls (`BatchedPrefill`)."""
    return count <= PREFILL_GRAPH_POSITIONS and cache.length + count <= cache.max_len


def replay_at(step: Callable[..., Any], cache: StaticKVCache, count: int, *inputs: torch.Tensor):
    """Run a graph-mode step (a `CapturedStep`, or the function itself) that appends `count` positions at the end
    of `cache`."""
    cache.begin(count)
    cache.position.fill_(cache.length)
    outputs = step(*inputs)
    cache.commit()
    return outputs


class PaddedPrefill:
    """A prefill of up to `size` positions as one graph: shorter inputs are padded with zeros. The padding's keys
    land beyond the cache's length, where masks hide them and the next write overwrites them.

    With `positioned`, the graph also takes rotary positions [3, 1, size] and, for `deepstack_layers` > 0,
    deepstack features [layers, 1, size, hidden]: the prefills of turns with video, at TMRoPE positions (a second
    of 4:3 camera is 108 tokens). Longer prefills (a cache rebuild, many held seconds of video) run eagerly: on
    the H200 two replays of 256 positions already cost what an eager prefill of 400 does."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], cache: StaticKVCache, hidden: int,
                 dtype: torch.dtype, size: int = PREFILL_GRAPH_POSITIONS, positioned: bool = False,
                 deepstack_layers: int = 0, graph: bool = True, pool: Any = None) -> None:
        self.cache, self.size, self.positioned, self.deepstack_layers = cache, size, positioned, deepstack_layers
        device = cache.position.device
        example = [torch.zeros(1, size, hidden, dtype=dtype, device=device)]
        if positioned:
            example.append(torch.zeros(3, 1, size, dtype=torch.long, device=device))
            if deepstack_layers:
                example.append(torch.zeros(deepstack_layers, 1, size, hidden, dtype=dtype, device=device))
        self.step = CapturedStep(fn, *example, graph=graph, pool=pool)

    def fits(self, count: int) -> bool:
        return count <= self.size and self.cache.length + self.size <= self.cache.max_len

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor | None = None,
                 deepstack: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Append `embeds` [1, T, hidden] (at `positions` [3, 1, T], with `deepstack` [layers, 1, T, hidden]
        where the graph takes them); returns its outputs for those T positions. After explicit positions the
        cache's next sequential position is the last token's largest + 1, as after an eager prefill."""
        count = embeds.shape[1]
        pad = self.size - count
        inputs = [torch.nn.functional.pad(embeds, (0, 0, 0, pad))]
        if self.positioned:
            inputs.append(torch.nn.functional.pad(positions, (0, pad)))
        if self.deepstack_layers:
            if deepstack is None:  # no video in these positions
                deepstack = embeds.new_zeros(self.deepstack_layers, 1, count, embeds.shape[-1])
            inputs.append(torch.nn.functional.pad(deepstack, (0, 0, 0, pad)))
        outputs = replay_at(self.step, self.cache, count, *inputs)
        if self.positioned:
            self.cache.set_next_position(int(positions[:, 0, -1].max()) + 1)
        return tuple(out[:, :count] for out in outputs)


class BatchedPrefill:
    """Short prefills (sequential positions, at most `PREFILL_GRAPH_POSITIONS`) of several rows of a batched
    cache as one step over its first rows, captured per batch size: each row is appended at its own length,
    padded with zeros (the padding lands past the row's length, where masks hide it), and rows without a prefill
    sit the step out on the scratch position. The weights are read once for all the rows: a turn end that comes
    to eight callers at once costs about what one costs.

    `fn(embeds, view)` runs the stack over `embeds` [rows, PREFILL_GRAPH_POSITIONS, hidden] appended to `view`
    (the first rows of `cache`, with positions of its own: a prefill on the main stream may still run when the
    next decode step sets the decode views' positions on a side stream) and returns its outputs, each
    [rows, PREFILL_GRAPH_POSITIONS, ...]. The steps of all batch sizes share `pool`: one runs at a time, and its
    outputs are copied out before another replays.

    Each batch size has a step per `KEY_BOUNDS` bound below the buffer's length, attending over that many keys
    only, and one over the whole buffer; a round takes the smallest that holds its rows' new positions. Why: the
    attention of a graphed step runs over the whole buffer under a mask, and for 24 rows of a 8192-position cache
    it was a third of the prefill's GPU time (H200: 21 of 65 ms, plus 11 ms of mask copies), for contexts that
    are mostly a few hundred positions long."""

    def __init__(self, cache: StaticKVCache, fn: Callable[[torch.Tensor, StaticKVCache], tuple[torch.Tensor, ...]],
                 hidden: int, dtype: torch.dtype, graph: bool, pool: Any = None) -> None:
        self.cache, self.fn, self.hidden, self.dtype, self.graph, self.pool = cache, fn, hidden, dtype, graph, pool
        self.device = cache.position.device
        self._views: dict[int, StaticKVCache] = {}
        self._steps: dict[int, CapturedStep] = {}
        self._inputs = DeviceCopy((3, cache.position.shape[0]), torch.long, self.device)

    def bounds(self) -> list[int | None]:
        """The key bounds of the steps of each batch size (None: the whole buffer)."""
        return [b for b in KEY_BOUNDS if b <= self.cache.scratch] + [None]

    def capture_all(self, rows: int) -> None:
        """The steps over the first `rows` rows for every key bound (at start-up: no call captures one)."""
        for bound in self.bounds():
            self.capture(rows, bound)

    def capture(self, rows: int, bound: int | None = None) -> CapturedStep:
        """The step over the first `rows` rows attending over the first `bound` keys (None: all), captured on
        first use (the engine captures them all at start-up)."""
        if (rows, bound) not in self._steps:
            view = self._views.setdefault(rows, self.cache.batch_view(rows))
            view.position.fill_(view.scratch)  # the capture's writes land in the scratch position
            example = torch.zeros(rows, PREFILL_GRAPH_POSITIONS, self.hidden, dtype=self.dtype, device=self.device)
            self._steps[rows, bound] = CapturedStep(lambda e: self._bounded(e, view, bound), example,
                                                    graph=self.graph, pool=self.pool)
        return self._steps[rows, bound]

    def _bounded(self, embeds: torch.Tensor, view: StaticKVCache, bound: int | None) -> tuple[torch.Tensor, ...]:
        view.key_bound = bound
        try:
            return self.fn(embeds, view)
        finally:
            view.key_bound = None

    def __call__(self, rows: int, prefills: list[tuple[int, StaticKVCache, torch.Tensor]]
                 ) -> list[tuple[torch.Tensor, ...]]:
        """`prefills`: (row, that row's own cache, embeds [1, T, hidden]) for distinct rows below `rows`. Returns
        each prefill's outputs for its T positions [1, T, ...], as copies."""
        end = max(cache.length for _, cache, _ in prefills) + PREFILL_GRAPH_POSITIONS  # (the padding's end too)
        step = self.capture(rows, next(b for b in self.bounds() if b is None or end <= b))
        embeds = torch.zeros(rows, PREFILL_GRAPH_POSITIONS, self.hidden, dtype=self.dtype, device=self.device)
        caches: list[StaticKVCache | None] = [None] * rows
        counts = [0] * rows
        for row, cache, part in prefills:
            embeds[row, :part.shape[1]] = part[0]
            caches[row], counts[row] = cache, part.shape[1]
        begin_rows(self._views[rows], caches, self._inputs, counts)
        outputs = step(embeds)
        commit_rows(caches)
        return [tuple(out[row:row + 1, :counts[row]].clone() for out in outputs) for row, _, _ in prefills]
