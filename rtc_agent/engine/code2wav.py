"""Streaming Code2Wav: one 80 ms frame of codes in, 1920 samples out, exact against a one-shot decode.

Code2Wav is causal. Its transformer (sliding window of 72 frames) runs incrementally on a KV cache, so every
frame sees exactly the context it would see in a one-shot decode. The convolutional upsampler is re-run on the
last `context` frames of transformer output plus the new one; `context` covers its receptive field, so the new
samples are exact too. A forward over T frames yields T*1920 - 555 samples (the causal transposed convolutions
hold back the tail), so the stream starts with 555 samples of silence: frame k then carries exactly the samples
[k*1920 - 555, (k+1)*1920 - 555) of the one-shot decode, every frame is 1920 samples, and nothing is dropped.

`Code2WavRows` holds every session slot's stream in batched buffers (a row a slot) and decodes a frame for every
answer of a batch in one step per number of frames before it: an answer's first `context` frames have a shorter
upsampler input, and answers that start together share those steps too.
"""
from __future__ import annotations

import torch

from .graphs import CapturedStep, DeviceCopy, begin_rows, commit_rows, replay_at
from .kv_cache import StaticKVCache
from .stack import run_stack

UPSAMPLER_CONTEXT_FRAMES = 6  # the upsampler's receptive field in frames: 6 is exact (1e-8), 4 is not (4e-5)


def _transform(model, codes: torch.Tensor, cache: StaticKVCache, graph_mode: bool) -> torch.Tensor:
    """The transformer's output [rows, hidden, 1] for one frame of codes per row ([rows, num_quantizers])."""
    embeds = model.code_embedding(codes[:, :, None] + model.code_offset).mean(1)
    out, _ = run_stack(model.pre_transformer, embeds, cache, mrope=False, graph_mode=graph_mode)
    return out.permute(0, 2, 1)


def _upsample(model, hidden: torch.Tensor) -> torch.Tensor:
    for blocks in model.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in model.decoder:
        hidden = block(hidden)
    return hidden.clamp(min=-1, max=1)


class StreamingCode2Wav:
    """One stream. `cache` and `history` may be rows of `Code2WavRows`' buffers (else its own are made)."""

    def __init__(self, code2wav, max_frames: int, context: int = UPSAMPLER_CONTEXT_FRAMES,
                 cache: StaticKVCache | None = None, history: torch.Tensor | None = None) -> None:
        self.model = code2wav
        config = code2wav.config
        self.samples_per_frame = int(code2wav.total_upsample)
        self.context = context
        param = next(code2wav.parameters())
        if cache is None:
            cache = StaticKVCache.for_config(config, max_frames, param.dtype, param.device, window=config.sliding_window)
        self.cache = cache
        # The last `context` frames of transformer output, the upsampler's left context.
        self.history = history if history is not None else param.new_zeros(1, config.hidden_size, context)
        self.lag = self._tail_loss()
        self.reset()

    def _tail_loss(self) -> int:
        """Samples a forward holds back at its end (555 for the released config), found by decoding one frame."""
        self.reset()
        codes = torch.zeros(1, self.model.config.num_quantizers, dtype=torch.long, device=self.history.device)
        produced = _upsample(self.model, _transform(self.model, codes, self.cache, graph_mode=False)).shape[-1]
        self.reset()
        return self.samples_per_frame - produced

    def reset(self) -> None:
        self.cache.crop(0)

    @property
    def frames_before(self) -> int:
        """Frames of upsampler context before the next one (`context` once the stream has that many)."""
        return min(self.cache.length, self.context)

    def push(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode one frame of codes [num_quantizers] and return its 1920 samples (float32, on the model's device).
        (The engine decodes its frames through `Code2WavRows.push`; this is the same step for one stream.)"""
        before = self.frames_before
        return replay_at(lambda c: decode_frame(self.model, c, self.cache, self.history, before, self.lag),
                         self.cache, 1, codes.view(1, -1))[0]


def decode_frame(model, codes: torch.Tensor, cache: StaticKVCache, history: torch.Tensor, before: int, lag: int,
                 active: torch.Tensor | None = None) -> torch.Tensor:
    """One frame for every row of `codes` [rows, num_quantizers] in fixed shapes (for a CUDA graph): each row with
    `before` frames of upsampler context (at most `history`'s), its transformer output appended to `history`
    [rows, hidden, context] (rows that are not `active` keep theirs). Returns the rows' samples [rows, 1920]."""
    context = history.shape[-1]
    hidden = _transform(model, codes, cache, graph_mode=True)
    window = torch.cat((history[..., context - before:], hidden), dim=-1)
    kept = torch.cat((history, hidden), dim=-1)[..., -context:]
    history.copy_(kept if active is None else torch.where(active[:, None, None], kept, history))
    return frame_samples(model, window, before, int(model.total_upsample), lag)


def frame_samples(model, window: torch.Tensor, before: int, samples_per_frame: int, lag: int) -> torch.Tensor:
    """The new frame's samples [rows, 1920] from the upsampled `window` (`before` frames of context, then the new
    one, per row)."""
    wav = _upsample(model, window)[:, 0].float()
    start = before * samples_per_frame - lag  # where this frame's samples begin in `wav`
    if start < 0:
        return torch.cat((wav.new_zeros(wav.shape[0], -start), wav[:, : samples_per_frame + start]), dim=1)
    return wav[:, start: start + samples_per_frame]


class Code2WavRows:
    """Every slot's stream, in batched buffers: `rows[b]` is slot b's (its own steps are not graphed: the
    engine's frames go through `push`); `push` decodes a frame for each row of a batch that has the same number of
    frames before it, in one step. The steps, per batch size and number of frames before, share one memory pool
    (one runs at a time, and `push` copies its output out)."""

    def __init__(self, code2wav, slots: int, max_frames: int, graphs: bool,
                 context: int = UPSAMPLER_CONTEXT_FRAMES) -> None:
        self.model = code2wav
        config = code2wav.config
        param = next(code2wav.parameters())
        self.context, self.graphs = context, graphs
        self.cache = StaticKVCache.for_config(config, max_frames, param.dtype, param.device, batch=slots,
                                              window=config.sliding_window)
        self.history = param.new_zeros(slots, config.hidden_size, context)
        self.rows = [StreamingCode2Wav(code2wav, max_frames, context, self.cache.row(b), self.history[b:b + 1])
                     for b in range(slots)]
        self._inputs = DeviceCopy((3, slots), torch.long, param.device)  # a step's positions, deltas, active rows
        self._views: dict[int, StaticKVCache] = {}
        self._steps: dict[tuple[int, int], CapturedStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def capture(self, rows: int) -> None:
        for before in range(self.context + 1):
            self._step_for(rows, before)

    def _step_for(self, rows: int, before: int) -> CapturedStep:
        if (rows, before) not in self._steps:
            view = self._views.setdefault(rows, self.cache.batch_view(rows))
            view.position.fill_(view.scratch)  # the capture's writes land in the scratch position
            codes = torch.zeros(rows, self.model.config.num_quantizers, dtype=torch.long, device=self.history.device)
            active = torch.zeros(rows, dtype=torch.bool, device=self.history.device)
            history, lag = self.history[:rows], self.rows[0].lag
            self._steps[rows, before] = CapturedStep(
                lambda c, a: decode_frame(self.model, c, view, history, before, lag, a), codes, active,
                graph=self.graphs, pool=self._pool)
        return self._steps[rows, before]

    def push(self, stepping: list[int | None], codes: torch.Tensor, before: int) -> torch.Tensor:
        """One frame for each row `stepping[i]` names (None: row i sits out) from `codes` [rows, 16], every one of
        those rows with `before` frames before it (`StreamingCode2Wav.frames_before`); returns samples [rows, 1920]
        (rows sitting out: meaningless)."""
        count = len(stepping)
        step = self._step_for(count, before)  # (a capture sets the positions: before they are filled in)
        caches = [self.rows[row].cache if row is not None else None for row in stepping]
        samples = step(codes, begin_rows(self._views[count], caches, self._inputs))
        commit_rows(caches)
        return samples.clone()
