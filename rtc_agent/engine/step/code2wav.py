"""Streaming Code2Wav: one 80 ms frame of codes in, 1920 samples out, exact against a one-shot decode.

Code2Wav is causal. Its transformer (sliding window of 72 frames) runs incrementally on a KV cache, so every
frame sees exactly the context it would see in a one-shot decode. The convolutional upsampler is re-run on the
last `context` frames of transformer output plus the new one; `context` covers its receptive field, so the new
samples are exact too. A forward over T frames yields T*1920 - 555 samples (the causal transposed convolutions
hold back the tail), so the stream starts with 555 samples of silence: frame k then carries exactly the samples
[k*1920 - 555, (k+1)*1920 - 555) of the one-shot decode, every frame is 1920 samples, and nothing is dropped.

The upsampler's decoder runs at 4 to 1920 samples a frame, and its last stages, where nearly all its work is, see
only a few dozen samples back: before each decoder stage the window is cut to the samples that the frame's 1920
depend on (`decoder_needs`), exactly, so that the 24 kHz stages work on about one frame instead of seven (the
tiny model's Code2Wav frame went from 16-20 to 9-11 ms on a 2-core CPU).

`Code2WavRows` holds every session slot's stream in batched buffers (a row a slot) and decodes a frame for every
answer of a batch with one step of the transformer for all of them, then one pass of the upsampler per number of
frames before it (an answer's first `context` frames have a shorter upsampler input) over just the rows that have
that many: when 24 answers start over five frames, their first frames cost five upsampler passes over 24 rows in
all, not five over 24 rows each (one step of the H200 went from 52 to 96 ms that way).
"""
from __future__ import annotations

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
)

from ..model.kv_cache import StaticKVCache
from ..model.stack import run_stack
from .graphs import CapturedStep, DeviceCopy, batch_sizes, begin_rows, commit_rows, replay_at, to_device

UPSAMPLER_CONTEXT_FRAMES = 6  # the upsampler's receptive field in frames: 6 is exact (1e-8), 4 is not (4e-5)


def _transform(model, codes: torch.Tensor, cache: StaticKVCache, graph_mode: bool) -> torch.Tensor:
    """The transformer's output [rows, hidden, 1] for one frame of codes per row ([rows, num_quantizers])."""
    embeds = model.code_embedding(codes[:, :, None] + model.code_offset).mean(1)
    out, _ = run_stack(model.pre_transformer, embeds, cache, mrope=False, graph_mode=graph_mode)
    return out.permute(0, 2, 1)


def _upsample(model, hidden: torch.Tensor, needs: list[int] | None = None) -> torch.Tensor:
    """The upsampler over `hidden` [rows, hidden, frames]; with `needs` (`decoder_needs`), each decoder stage sees
    only the last samples that the output's last samples depend on."""
    for blocks in model.upsample:
        for block in blocks:
            hidden = block(hidden)
    for index, block in enumerate(model.decoder):
        if needs is not None:
            hidden = hidden[..., -needs[index]:]
        hidden = block(hidden)
    return hidden.clamp(min=-1, max=1)


def decoder_needs(model, samples: int) -> list[int]:
    """For each stage of the decoder, how many of its last input samples the decoder's last `samples` output
    samples depend on. Every stage's output ends where its input ends (causal convolutions; a transposed one's
    output is cut by its overlap on both sides), so these are exact."""
    needs = []
    for stage in reversed(model.decoder):
        samples = _needed_input(stage, samples)
        needs.append(samples)
    return needs[::-1]


def _needed_input(module, samples: int) -> int:
    if isinstance(module, Qwen3OmniMoeCausalConvNet):
        assert module.stride == 1, "a strided convolution's output does not end where its input does"
        return samples + module.padding  # (its receptive field less one)
    if isinstance(module, Qwen3OmniMoeCausalTransConvNet):
        (kernel,), (stride,) = module.conv.kernel_size, module.conv.stride
        # (output t reads the inputs i with i * stride <= t < i * stride + kernel)
        return -(-(samples + kernel) // stride) - 1
    if isinstance(module, Qwen3OmniMoeCode2WavDecoderResidualUnit):
        return _needed_input(module.conv1, _needed_input(module.conv2, samples))
    if isinstance(module, Qwen3OmniMoeCode2WavDecoderBlock):
        for part in reversed(module.block):
            samples = _needed_input(part, samples)
        return samples
    return samples  # a pointwise activation


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
            cache = StaticKVCache.for_config(config, max_frames, param.dtype, param.device,
                                             window=config.sliding_window)
        self.cache = cache
        # The last `context` frames of transformer output, the upsampler's left context.
        self.history = history if history is not None else param.new_zeros(1, config.hidden_size, context)
        self.lag = self._tail_loss()
        self.needs = decoder_needs(code2wav, self.samples_per_frame)
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
        return replay_at(lambda c: decode_frame(self.model, c, self.cache, self.history, before, self.needs),
                         self.cache, 1, codes.view(1, -1))[0]


def advance(model, codes: torch.Tensor, cache: StaticKVCache, history: torch.Tensor,
            active: torch.Tensor | None = None) -> torch.Tensor:
    """The transformer's step for one frame of codes per row ([rows, num_quantizers]) in fixed shapes (for a CUDA
    graph). Returns each row's upsampler window [rows, hidden, context + 1]: the last `context` frames of
    transformer output (`history`), then the new one, which `history` keeps in place of its oldest (rows that are
    not `active` keep theirs)."""
    window = torch.cat((history, _transform(model, codes, cache, graph_mode=True)), dim=-1)
    history.copy_(window[..., 1:] if active is None else torch.where(active[:, None, None], window[..., 1:], history))
    return window


def decode_frame(model, codes: torch.Tensor, cache: StaticKVCache, history: torch.Tensor, before: int,
                 needs: list[int]) -> torch.Tensor:
    """One frame for every row of `codes` with `before` frames of upsampler context (at most `history`'s): the
    rows' samples [rows, 1920]."""
    window = advance(model, codes, cache, history)
    return frame_samples(model, window[..., window.shape[-1] - 1 - before:], needs)


def frame_samples(model, window: torch.Tensor, needs: list[int]) -> torch.Tensor:
    """The new frame's samples [rows, 1920] from the upsampled `window` (frames of context, then the new one, per
    row): the last 1920 samples of the upsampler's output, after zeros while the stream has fewer (its first
    `lag`)."""
    samples_per_frame = int(model.total_upsample)
    wav = _upsample(model, window, needs)[:, 0, -samples_per_frame:].float()
    if wav.shape[-1] < samples_per_frame:
        return torch.cat((wav.new_zeros(wav.shape[0], samples_per_frame - wav.shape[-1]), wav), dim=1)
    return wav


class Code2WavRows:
    """Every slot's stream, in batched buffers: `rows[b]` is slot b's (its own steps are not graphed: the
    engine's frames go through `push`). `push` decodes a frame for each row of a batch: one transformer step for
    them all, then the upsampler once per number of frames before the new one, over the rows with that many (the
    smallest captured batch that holds them). The steps share one memory pool (one runs at a time, and `push`
    copies each output out before the next replays)."""

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
        self._steps: dict[int, CapturedStep] = {}  # rows -> the transformer's step
        self._upsamplers: dict[tuple[int, int], CapturedStep] = {}  # (rows, frames before) -> the upsampler's pass
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def capture(self, rows: int) -> None:
        self._step_for(rows)
        for before in range(self.context + 1):
            self._upsampler_for(rows, before)

    def _step_for(self, rows: int) -> CapturedStep:
        if rows not in self._steps:
            view = self._views.setdefault(rows, self.cache.batch_view(rows))
            view.position.fill_(view.scratch)  # the capture's writes land in the scratch position
            codes = torch.zeros(rows, self.model.config.num_quantizers, dtype=torch.long, device=self.history.device)
            active = torch.zeros(rows, dtype=torch.bool, device=self.history.device)
            history = self.history[:rows]
            self._steps[rows] = CapturedStep(lambda c, a: advance(self.model, c, view, history, a), codes, active,
                                             graph=self.graphs, pool=self._pool)
        return self._steps[rows]

    def _upsampler_for(self, rows: int, before: int) -> CapturedStep:
        if (rows, before) not in self._upsamplers:
            window = self.history.new_zeros(rows, self.history.shape[1], before + 1)
            needs = self.rows[0].needs
            self._upsamplers[rows, before] = CapturedStep(
                lambda w: frame_samples(self.model, w, needs), window, graph=self.graphs,
                pool=self._pool)
        return self._upsamplers[rows, before]

    def push(self, befores: list[int | None], codes: torch.Tensor) -> torch.Tensor:
        """One frame for each row i of the batch whose `befores[i]` is not None (the others sit out) from `codes`
        [rows, 16], row i with `befores[i]` frames before it (`StreamingCode2Wav.frames_before`); returns samples
        [rows, 1920] (rows sitting out: zeros)."""
        count = len(befores)
        step = self._step_for(count)  # (a capture sets the positions: before they are filled in)
        caches = [self.rows[row].cache if before is not None else None for row, before in enumerate(befores)]
        window = step(codes, begin_rows(self._views[count], caches, self._inputs)).clone()
        commit_rows(caches)
        groups: dict[int, list[int]] = {}
        for row, before in enumerate(befores):
            if before is not None:
                groups.setdefault(before, []).append(row)
        samples = torch.zeros(count, int(self.model.total_upsample), device=window.device)
        for before, members in groups.items():
            size = next(size for size in batch_sizes(len(self.rows)) if size >= len(members))
            index = to_device(torch.tensor(members + members[:1] * (size - len(members))), window.device)
            part = self._upsampler_for(size, before)(window.index_select(0, index)[..., self.context - before:])
            samples.index_copy_(0, index[:len(members)], part[:len(members)])
        return samples
