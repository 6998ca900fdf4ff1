"""Session slots: everything one call needs on the device, made once at start-up and handed from call to call.

A slot is a row of the engine's batched KV caches (Thinker, Talker, code predictor, Code2Wav), its own prefill
graphs, and a random generator. The batched steps (a Thinker token, a Talker step, the code predictor's 15 steps, a
Code2Wav frame, short Thinker and Talker prefills) run over the first `rows` rows for a few batch sizes (1, 2, 4,
... up to the slot count), each captured as a CUDA graph once at start-up. Slots are handed out lowest first, so the
callers of a busy server sit in the first rows and a step's batch stays small. A call that ends gives its slot back
(reset, never re-allocated or re-captured): joining or leaving costs the other callers nothing.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..events import FRAME_SAMPLES
from ..model.kernels import moe
from ..model.kv_cache import StaticKVCache
from ..model.memory import free_bytes
from ..model.stack import run_stack
from ..step.code2wav import Code2WavRows, StreamingCode2Wav
from ..step.graphs import (
    VIDEO_PREFILL_POSITIONS,
    BatchedPrefill,
    CapturedStep,
    DeviceCopy,
    HostCopy,
    PaddedPrefill,
    batch_sizes,
    begin_rows,
    commit_rows,
    rows_for,
    to_device,
)
from ..step.sampling import Sampling, choose, draw_groups, fused_active, gumbel_rows, noise_width
from ..step.talker import Talker, TalkerRow
from ..step.tools import Constraint, TokenMasks
from .policy import PrefillRequest, TokenRequest

if TYPE_CHECKING:
    from ..session.engine import Engine  # the engine's model, options and pool (an import cycle at run time)

log = logging.getLogger(__name__)


DEFAULT_CPU_SLOTS = 4
# The engine alone keeps 24 answers in real time on one H200 (bench: RTF 0.62; 32: 1.02), and the calls' media run
# in media processes beside it (server/processes.py). More slots only when asked for (--max-sessions).
MAX_AUTO_SLOTS = 24
GPU_RESERVE_BYTES = 6 << 30  # prefill activations (a long video turn), cuBLAS workspaces, the allocator's slack
SLOT_OVERHEAD = 1.5  # a slot's graphs and Code2Wav buffers on top of its KV caches (measured: docs/performance.md)
MAX_KEPT_PROMPTS = 8  # system prompts whose keys and values are kept for new calls (≈ 20 MB each at full size)


def _cache_bytes(config, positions: int, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * (positions + 1) * head_dim * dtype.itemsize


def slot_bytes(core: Engine) -> int:
    """Bytes of one slot's KV caches: Thinker, Talker, code predictor, Code2Wav."""
    return _slot_bytes(core.model.config, core.options, core.dtype, core.speech)


def estimated_slot_bytes(options) -> float:
    """What one slot takes on the GPU (its caches and their overhead) for the released model in bf16, before any
    model is loaded: for `quantize="auto"`."""
    from transformers import Qwen3OmniMoeConfig

    from ..model.tiny import released_config_dict
    config = Qwen3OmniMoeConfig(**released_config_dict())
    return _slot_bytes(config, options, torch.bfloat16, not options.text_only) * SLOT_OVERHEAD


def _slot_bytes(config, options, dtype: torch.dtype, speech: bool) -> int:
    total = _cache_bytes(config.thinker_config.text_config, options.context_tokens, dtype)
    if speech:
        talker = config.talker_config
        total += _cache_bytes(talker.text_config, options.context_tokens + options.max_frames + 16, dtype)
        total += _cache_bytes(talker.code_predictor_config, talker.num_code_groups + 1, dtype)
        total += _cache_bytes(config.code2wav_config, options.max_frames + 1, dtype)
    return total


def slot_count(core: Engine, requested: int) -> int:
    """`requested`, or (0) as many slots as fit in the GPU's free memory after the weights (logged), at most
    `MAX_AUTO_SLOTS`; `DEFAULT_CPU_SLOTS` on the CPU."""
    if requested:
        return requested
    if core.device.type != "cuda":
        return DEFAULT_CPU_SLOTS
    free, total = free_bytes(core.device)
    per_slot = int(slot_bytes(core) * SLOT_OVERHEAD)
    count = max(1, min(MAX_AUTO_SLOTS, (free - GPU_RESERVE_BYTES) // per_slot))
    log.info("session slots: %d (at most %d). After the weights %.1f GB of %.1f GB are free; %.1f GB stay in "
             "reserve for prefills; a slot takes %.2f GB (%.2f GB of KV caches x %.1f for its graphs and buffers)",
             count, MAX_AUTO_SLOTS, free / 1e9, total / 1e9, GPU_RESERVE_BYTES / 1e9, per_slot / 1e9,
             slot_bytes(core) / 1e9, SLOT_OVERHEAD)
    return int(count)


@dataclass
class Slot:
    index: int
    cache: StaticKVCache  # the Thinker's context: row `index` of the pool's cache
    prefill: PaddedPrefill | None  # short Thinker prefills on that row as one graph (GPU)
    video_prefill: PaddedPrefill | None  # and those at TMRoPE positions, with video (GPU, calls with video)
    talker: TalkerRow | None
    code2wav: StreamingCode2Wav | None
    generator: torch.Generator
    answer: Any = None  # the answer in progress on this slot, if any (answer.Answer)

    def reset(self, seed: int | None) -> None:
        """A new call: empty context, the generator seeded (`seed`, or from the system's entropy)."""
        self.answer = None
        self.cache.crop(0)
        if self.talker is not None:
            self.talker.reset()
            self.code2wav.reset()
        self.generator.manual_seed(seed if seed is not None else int(torch.seed() % 2**62))


@dataclass(frozen=True)
class FirstToken:
    """What `SlotPool.first_tokens` sends back for a `TokenRequest`: the token (row `row` of the round's `tokens`,
    on their way to the host) and, for a request with a `talker_prefix`, the answer's whole Talker prefix: that
    one, then the token's text input over codec_bos [1, 9, hidden] (made with the other requests' in one pass, on
    the device: each session's own ops here took ≈ 0.5 ms of the worker's thread while the GPU waited, 12 ms for a
    burst of 24 turn ends on the H200).

    The token is read when first asked for, not by the round: the sessions' host work up to their Talker
    prefills then runs while the GPU is still at the round's Thinker prefill, instead of after it (a burst of 24
    turn ends on the H200: ≈ 20 ms of that host work with the GPU idle)."""

    tokens: HostCopy
    row: int
    talker_prefix: torch.Tensor | None

    @property
    def token(self) -> int:
        return int(self.tokens.get()[self.row])


class SlotPool:
    def __init__(self, core: Engine, count: int) -> None:
        self.core = core
        model, options = core.model, core.options
        thinker_config = model.config.thinker_config.text_config
        graphs = core.cuda_graphs
        self.graphs = graphs
        self.cache = StaticKVCache.for_config(thinker_config, options.context_tokens, core.dtype, core.device,
                                              batch=count)
        self.talker = self.code2wav = None
        if core.speech:
            fused = fused_active(options.fast_sampling, core.device)
            self.talker = Talker(model, count, options.context_tokens + options.max_frames + 16, graphs, fused,
                                 video=bool(options.video_window_s))
            self.code2wav = Code2WavRows(model.code2wav, count, options.max_frames + 1, graphs)
        # The Thinker's steps next to the frames, on a high-priority stream: a stream of its own (torch hands out
        # normal-priority streams round-robin from a pool of 32) and first on the GPU when both streams have work.
        self.side_stream = torch.cuda.Stream(core.device, priority=-1) if graphs and options.overlap else None
        self._step_inputs = DeviceCopy((3, count), torch.long, core.device)  # a step's positions, deltas, active rows
        self._ids = DeviceCopy((count, 1), torch.long, core.device)  # a Thinker step's input tokens
        self._tokens = HostCopy((count,), torch.long, core.device)  # its chosen tokens
        self.masks = TokenMasks(count, model.thinker.lm_head.out_features, core.device)  # function calls' grammar
        if core.speech:  # each frame's codes and samples
            groups = model.config.talker_config.num_code_groups
            self.frame_codes = HostCopy((count, groups), torch.long, core.device)
            self.frame_samples = HostCopy((count, FRAME_SAMPLES), torch.float32, core.device)
        self._views: dict[int, StaticKVCache] = {}  # per batch size, for the decode steps
        self._thinker_steps: dict[int, CapturedStep] = {}
        self._prefill_pool = torch.cuda.graph_pool_handle() if graphs else None  # the slots' own prefill graphs too
        self._batched_prefill = BatchedPrefill(self.cache, self.thinker_stack, thinker_config.hidden_size, core.dtype,
                                               graphs, self._prefill_pool)
        self._prompts: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # see start_with
        self.slots = [self._make_slot(index) for index in range(count)]
        self._free = list(range(count))
        self._lock = threading.Lock()  # slots are taken on the event loop and given back on the worker

    def _make_slot(self, index: int) -> Slot:
        core = self.core
        cache = self.cache.row(index)
        prefill = video_prefill = None
        if self.graphs:
            hidden = core.model.config.thinker_config.text_config.hidden_size
            prefill = PaddedPrefill(lambda e: self.thinker_stack(e, cache, graph_mode=True), cache, hidden, core.dtype)
            if core.options.video_window_s:
                video_prefill = self.video_prefill(cache)
        code2wav = self.code2wav.rows[index] if self.code2wav is not None else None
        talker = self.talker.rows[index] if self.talker is not None else None
        return Slot(index, cache, prefill, video_prefill, talker, code2wav, torch.Generator(device=core.device))

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return len(self._free)

    def capture(self, talker_sampling: Sampling, predictor_sampling: Sampling) -> None:
        """The batched steps for every batch size (CUDA graphs on the GPU), so no call captures any."""
        for rows in batch_sizes(len(self.slots)):
            self._thinker_step(rows)
            if rows > 1:
                self._batched_prefill.capture_all(rows)
            if self.talker is not None:
                self.talker.capture(rows, talker_sampling, predictor_sampling)
                self.code2wav.capture(rows)

    def acquire(self) -> Slot | None:
        """The lowest free slot, or None when every slot is taken."""
        with self._lock:
            return self.slots[self._free.pop(0)] if self._free else None

    def release(self, slot: Slot) -> None:
        """Give a slot back; `reset` clears it when it is next taken."""
        with self._lock:
            if slot.index not in self._free:
                self._free.append(slot.index)
                self._free.sort()

    def start_with(self, slot: Slot, ids: list[int], prefill: Callable[[], None]) -> None:
        """Fill `slot`'s empty Thinker cache with `ids` (a system prompt, at positions 0 to n - 1): a copy of the
        keys and values kept since a call first prefilled the same ids, which are the same in every slot, or else
        `prefill()` and keep a copy. A new call so starts without the eager prefill of its system prompt (tens of
        milliseconds on the worker, during which no other call's frame is made)."""
        cache, key = slot.cache, tuple(ids)
        if cache.length:
            raise ValueError("a system prompt goes into an empty cache")
        kept = self._prompts.get(key)
        if kept is None:
            prefill()
            if len(self._prompts) >= MAX_KEPT_PROMPTS:
                del self._prompts[next(iter(self._prompts))]
            self._prompts[key] = ([k[:, :, :len(ids)].clone() for k in cache.keys],
                                  [v[:, :, :len(ids)].clone() for v in cache.values])
            return
        cache.begin(len(ids))
        for buffers, copies in zip((cache.keys, cache.values), kept):
            for buffer, copy in zip(buffers, copies):
                buffer[:, :, :len(ids)].copy_(copy)
        cache.commit()

    # ----- the Thinker ----------------------------------------------------------------------------------------
    def thinker_stack(self, embeds: torch.Tensor, cache: StaticKVCache, graph_mode: bool = True,
                      positions: torch.Tensor | None = None,
                      deepstack: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Thinker layers over `embeds`; also returns the hidden states the Talker reads (accept_hidden_layer)."""
        lm = self.core.model.thinker.model.language_model
        capture = self.core.model.config.talker_config.accept_hidden_layer if self.talker is not None else None
        hidden, captured = run_stack(lm, embeds, cache, mrope=True, capture_layer=capture, graph_mode=graph_mode,
                                     positions=positions, deepstack=deepstack)
        return hidden, hidden if captured is None else captured

    def video_prefill(self, cache: StaticKVCache, size: int = VIDEO_PREFILL_POSITIONS,
                      graph: bool = True) -> PaddedPrefill:
        """A slot's graphed prefill at TMRoPE positions with deepstack features (`graph` False: the same code run
        eagerly, as the CPU tests do)."""
        config = self.core.model.config.thinker_config
        return PaddedPrefill(lambda e, p, d: self.thinker_stack(e, cache, graph_mode=True, positions=p, deepstack=d),
                             cache, config.text_config.hidden_size, self.core.dtype, size, positioned=True,
                             deepstack_layers=len(config.vision_config.deepstack_visual_indexes), graph=graph,
                             pool=self._prefill_pool)

    def prefill_at(self, slot: Slot, embeds: torch.Tensor, positions: torch.Tensor | None,
                   deepstack: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A Thinker prefill of one slot at explicit TMRoPE `positions` [3, 1, T] (None: sequential) with video's
        `deepstack` features [layers, 1, T, hidden] (or None): through the slot's positioned graph where it fits
        (a turn's second of video: ≈ 120 tokens), else eagerly (a cache rebuild)."""
        graph = slot.video_prefill
        if graph is not None and positions is not None and graph.fits(embeds.shape[1]):
            return graph(embeds, positions, deepstack)
        return self.thinker_stack(embeds, slot.cache, graph_mode=False, positions=positions, deepstack=deepstack)

    def _thinker_step(self, rows: int) -> CapturedStep:
        if rows not in self._thinker_steps:
            view = self._view(rows, capture=True)

            active = self._step_inputs.device[2, :rows]  # (begin_rows sets it before every replay)

            def logits(ids: torch.Tensor) -> torch.Tensor:
                lm = self.core.model.thinker.model.language_model
                with moe.skipping_rows(active):  # the rows sitting the step out read no expert weights
                    hidden, _ = run_stack(lm, lm.embed_tokens(ids), view, mrope=True, graph_mode=True)
                return self.core.model.thinker.lm_head(hidden[:, -1])

            self._thinker_steps[rows] = CapturedStep(logits, torch.zeros(rows, 1, dtype=torch.long,
                                                                         device=self.core.device),
                                                     stream=self.side_stream, graph=self.graphs)
        return self._thinker_steps[rows]

    def _view(self, rows: int, capture: bool = False) -> StaticKVCache:
        """The first `rows` rows of the Thinker's cache as one cache, for decode steps; for a `capture`, every row
        at the scratch position, so the capture's writes land there."""
        if rows not in self._views:
            self._views[rows] = self.cache.batch_view(rows)
        view = self._views[rows]
        if capture:
            view.position.fill_(view.scratch)
        return view

    def prefill(self, requests: list[PrefillRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run short Thinker prefills of distinct slots; returns each one's (hidden, captured) [1, T, hidden]. One
        request runs alone (its slot's graph, or eagerly on the CPU); several run as one batched step over the
        first rows (`BatchedPrefill`)."""
        if len(requests) == 1:
            slot, embeds = requests[0].slot, requests[0].embeds
            if slot.prefill is not None and slot.prefill.fits(embeds.shape[1]):
                return [slot.prefill(embeds)]
            return [self.thinker_stack(embeds, slot.cache, graph_mode=False)]
        rows = rows_for(max(r.slot.index for r in requests), len(self.slots))
        return self._batched_prefill(rows, [(r.slot.index, r.slot.cache, r.embeds) for r in requests])

    def first_tokens(self, requests: list[TokenRequest]) -> list[FirstToken]:
        """Each request's token, as `choose` picks it for that row alone (`choose_rows`), on its way to the host
        (`FirstToken.token` waits for it); the Talker prefixes of the requests that speak."""
        logits = self.core.model.thinker.lm_head(torch.cat([r.hidden.reshape(1, -1) for r in requests]))
        for i, request in enumerate(requests):
            if request.allowed is not None:
                logits[i:i + 1] = self.masks.apply(logits[i:i + 1], request.allowed)
        tokens = choose_rows(logits, [r.generator for r in requests], [r.sampling for r in requests])
        speaking = [i for i, r in enumerate(requests) if r.talker_prefix is not None]
        prefixes: dict[int, torch.Tensor] = {}
        if speaking:
            chosen = tokens if len(speaking) == len(requests) else tokens.index_select(
                0, to_device(torch.tensor(speaking), tokens.device))
            inputs = self.core.talker_inputs
            first = inputs.project_text(self.core.model.thinker.model.language_model.embed_tokens(chosen[:, None]))
            whole = torch.cat((torch.cat([requests[i].talker_prefix for i in speaking]), first + inputs.codec_bos),
                              dim=1)
            prefixes = {i: whole[n:n + 1] for n, i in enumerate(speaking)}
        host = HostCopy(tuple(tokens.shape), tokens.dtype, tokens.device)  # (each round its own: read later)
        host.start(tokens)
        return [FirstToken(host, i, prefixes.get(i)) for i in range(len(requests))]

    def start_tokens(self, rows: list, samplings: list[Sampling], overlap: bool,
                     constraints: dict[int, Constraint] | None = None) -> None:
        """Queue the next Thinker token of a batch: `rows[i]` is (slot, previous token, generator) for row i, or
        None where row i sits the step out; `constraints`: what some rows may draw (`TokenMasks`; the others,
        any token). With `overlap` (and a side stream) the step runs on the side stream, next to whatever the main
        stream does until `tokens()` is called."""
        count = len(rows)
        step = self._thinker_step(count)  # (a capture sets the positions: before they are filled in)
        caches = [row[0].cache if row is not None else None for row in rows]
        self._ids.wait_sent()
        for i, row in enumerate(rows):
            self._ids.host[i, 0] = row[1] if row is not None else 0
        stream = self.side_stream if overlap else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            begin_rows(self._view(count), caches, self._step_inputs)
            logits = step(self._ids.send()[:count])
            masks = self.masks.send(constraints or {})  # (computed while the GPU runs the step)
            if masks is not None:
                logits = self.masks.apply(logits, masks[:count])
            self._tokens.start(choose_rows(logits, [r and r[2] for r in rows], samplings))
        commit_rows(caches)

    def tokens(self) -> list[int]:
        """The tokens of the batch `start_tokens` queued (waits for that step only)."""
        return self._tokens.get().tolist()


def choose_rows(logits: torch.Tensor, generators: list, samplings: list[Sampling]) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab], row i drawn under `samplings[i]` with `generators[i]` (rows
    whose generator is None sit out: their token is the greedy one and unused). Rows whose settings differ only
    in `greedy` are drawn together: a greedy row gets zero noise, and the argmax survives every cut. A top-k cut
    draws among its candidates only (`noise_width`)."""
    draws = [g if not s.greedy else None for g, s in zip(generators, samplings)]
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for sampling, members in draw_groups(samplings, [g is not None for g in draws]).items():
        noise = None if sampling.greedy else gumbel_rows([draws[i] for i in members],
                                                         noise_width(sampling, logits.shape[1]), logits.device)
        index = to_device(torch.tensor(members), logits.device) if len(members) < logits.shape[0] else None
        rows = logits if index is None else logits.index_select(0, index)
        chosen = choose(rows, sampling, noise=noise)
        if index is None:
            tokens = chosen
        else:
            tokens.index_copy_(0, index, chosen)
    return tokens
