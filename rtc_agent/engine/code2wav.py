"""Streaming Code2Wav: one 80 ms frame of codes in, 1920 samples out, exact against a one-shot decode.

Code2Wav is causal. Its transformer (sliding window of 72 frames) runs incrementally on a KV cache, so every
frame sees exactly the context it would see in a one-shot decode. The convolutional upsampler is re-run on the
last `context` frames of transformer output plus the new one; `context` covers its receptive field, so the new
samples are exact too. A forward over T frames yields T*1920 - 555 samples (the causal transposed convolutions
hold back the tail), so the stream starts with 555 samples of silence: frame k then carries exactly the samples
[k*1920 - 555, (k+1)*1920 - 555) of the one-shot decode, every frame is 1920 samples, and nothing is dropped.
"""
from __future__ import annotations

import torch

from .graphs import CapturedStep, replay_at
from .kv_cache import StaticKVCache
from .stack import run_stack

UPSAMPLER_CONTEXT_FRAMES = 6  # the upsampler's receptive field in frames: 6 is exact (1e-8), 4 is not (4e-5)


class StreamingCode2Wav:
    def __init__(self, code2wav, max_frames: int, context: int = UPSAMPLER_CONTEXT_FRAMES, graphs: bool = False) -> None:
        self.model = code2wav
        config = code2wav.config
        self.samples_per_frame = int(code2wav.total_upsample)
        self.context = context
        param = next(code2wav.parameters())
        self.cache = StaticKVCache.for_config(config, max_frames, param.dtype, param.device, window=config.sliding_window)
        self.hidden: torch.Tensor | None = None  # eager path: transformer output of the last context + 1 frames
        self.lag = self._tail_loss()
        # On the GPU every frame is one graph replay: one graph per number of frames before it (0 .. context, the
        # last one for every frame from then on), over a static buffer of the last `context` transformer frames.
        self._history = param.new_zeros(1, config.hidden_size, context)
        self._graphs: list[CapturedStep] = []
        if graphs:
            codes = torch.zeros(config.num_quantizers, dtype=torch.long, device=param.device)
            for before in range(context + 1):
                self._graphs.append(CapturedStep(lambda c, before=before: self._push_static(c, before), codes))
                self.reset()

    def _tail_loss(self) -> int:
        """Samples a forward holds back at its end (555 for the released config), found by decoding one frame."""
        self.reset()
        codes = torch.zeros(1, self.model.config.num_quantizers, 1, dtype=torch.long, device=self.cache.keys[0].device)
        produced = self._upsample(self._transform(codes)).shape[-1]
        self.reset()
        return self.samples_per_frame - produced

    def reset(self) -> None:
        self.cache.crop(0)
        self.hidden = None

    def _transform(self, codes: torch.Tensor, graph_mode: bool = False) -> torch.Tensor:
        model = self.model
        embeds = model.code_embedding(codes + model.code_offset).mean(1)
        out, _ = run_stack(model.pre_transformer, embeds, self.cache, mrope=False, graph_mode=graph_mode)
        return out.permute(0, 2, 1)

    def _upsample(self, hidden: torch.Tensor) -> torch.Tensor:
        for blocks in self.model.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.model.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)

    def push(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode one frame of codes [num_quantizers] and return its 1920 samples (float32, on the model's device)."""
        if self._graphs:
            return replay_at(self._graphs[min(self.cache.length, self.context)], self.cache, 1, codes).clone()
        hidden = self._transform(codes.view(1, -1, 1))
        window = hidden if self.hidden is None else torch.cat((self.hidden, hidden), dim=-1)[..., -(self.context + 1):]
        wav = self._frame_samples(window, window.shape[-1] - 1)
        self.hidden = window
        return wav

    def _push_static(self, codes: torch.Tensor, before: int) -> torch.Tensor:
        """`push` with `before` frames of history (at most `context`) in fixed shapes, for a CUDA graph."""
        hidden = self._transform(codes.view(1, -1, 1), graph_mode=True)
        window = torch.cat((self._history[..., self.context - before:], hidden), dim=-1)
        self._history.copy_(torch.cat((self._history, hidden), dim=-1)[..., -self.context:])
        return self._frame_samples(window, before)

    def _frame_samples(self, window: torch.Tensor, before: int) -> torch.Tensor:
        """The new frame's samples from the upsampled `window` (`before` frames of context, then the new one)."""
        wav = self._upsample(window)[0, 0].float()
        start = before * self.samples_per_frame - self.lag  # where this frame's samples begin in `wav`
        if start < 0:
            return torch.cat((wav.new_zeros(-start), wav[: self.samples_per_frame + start]))
        return wav[start: start + self.samples_per_frame]
