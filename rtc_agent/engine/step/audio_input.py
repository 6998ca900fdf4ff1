"""Caller audio into the Thinker: validation, log-mel features, and the audio encoder.

Each encoded chunk is its own attention window (the model was trained with 1-8 s windows), so a turn can be
encoded piece by piece while the caller is still talking.

The encoder runs as fixed-shape steps (`AudioEncoder`), CUDA graphs on the GPU. Why: the library's encoder sizes
everything from its input (chunks padded to the longest one, valid tokens kept by index, attention run window by
window with the window lengths read back from the device in each of its 32 layers). On the H200 that is about
13 ms of host work for 2.6 ms of GPU work per pass, and with eight callers the media threads' Python competes
with it for the GIL: 24-80 ms per pass, during which no batched frame is started. A graph replay is one call.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..events import INPUT_SAMPLE_RATE
from ..model.kernels.attention import LONG_PREFILL_BACKENDS
from .graphs import CapturedStep, to_device

MEL_HOP = 160  # samples per mel frame at 16 kHz (100 frames/s)


def check_samples(samples: np.ndarray) -> np.ndarray:
    """Return `samples` as contiguous float32 mono, or raise ValueError saying what is wrong."""
    if not isinstance(samples, np.ndarray):
        raise ValueError(f"audio must be a numpy array, got {type(samples).__name__}")
    if samples.ndim != 1:
        raise ValueError(f"audio must be mono (1-D) at {INPUT_SAMPLE_RATE} Hz, got shape {samples.shape}")
    if samples.dtype.kind != "f":
        raise ValueError(f"audio must be float samples in [-1, 1] at {INPUT_SAMPLE_RATE} Hz, got dtype {samples.dtype}")
    if not np.isfinite(samples).all():
        raise ValueError("audio contains NaN or infinite samples")
    return np.ascontiguousarray(samples, dtype=np.float32)


def log_mel(feature_extractor, samples: np.ndarray) -> torch.Tensor:
    """Whisper log-mel features [mel_bins, frames] of one stretch of 16 kHz audio, unpadded, as the library's
    feature extractor makes them (what stock transformers is given; the engine uses `LogMel`)."""
    out = feature_extractor(samples, sampling_rate=INPUT_SAMPLE_RATE, padding="longest", truncation=False,
                            return_attention_mask=True, return_tensors="pt")
    frames = int(out["attention_mask"].sum())
    return out["input_features"][0, :, :frames]


class LogMel:
    """The same features as `log_mel` (the library's torch path, the same operations in the same order, the
    centred STFT's reflection padding done first: equal on the CPU; 5e-6 apart on the H200), made on the engine's
    device and left there. Why: the library computes them on the worker's CPU thread, 0.75 ms a second of audio
    on the H200 machine when idle and several times that when a burst of turn ends keeps every core busy, a third
    of a preparation's host time; with them on the GPU, 24 turn ends at once got their first packets after 74-85
    instead of 94-115 ms P50 (A/B/A/B on one H200 host, `studies/device_ab.sh`)."""

    def __init__(self, feature_extractor, device: torch.device) -> None:
        if feature_extractor.dither:
            raise ValueError("dithered log-mel features are not supported")
        self.n_fft, self.hop = feature_extractor.n_fft, feature_extractor.hop_length
        self.device = device
        self.window = torch.hann_window(self.n_fft, device=device)
        self.filters = torch.from_numpy(feature_extractor.mel_filters).to(device, torch.float32)

    def __call__(self, samples: np.ndarray) -> torch.Tensor:
        """Features [mel_bins, frames] of one stretch of 16 kHz float32 audio (frames: samples // hop)."""
        return self.many([samples])[0]

    def many(self, stretches: list[np.ndarray]) -> list[torch.Tensor]:
        """Features of stretches of any lengths, as `__call__` makes each, in one batch on the device: each stretch
        reflect-padded on the host as the library's centred STFT pads it, zero-padded to the longest, one copy to
        the device; a stretch's frames past its own end are dropped and left out of its floor. Why: the audio
        stage of a round makes every caller's features at once (24 turn ends: one set of launches, not 24 of
        about 1 ms of the worker's host time each, H200)."""
        half = self.n_fft // 2
        padded = [np.pad(np.asarray(s, np.float32), half, mode="reflect") for s in stretches]
        rows = np.zeros((len(padded), max(len(p) for p in padded)), np.float32)
        for row, p in zip(rows, padded):
            row[:len(p)] = p
        frames = [len(s) // self.hop for s in stretches]
        features = self._log_spectra(to_device(torch.from_numpy(rows), self.device), frames)
        return [f[:, :n] for f, n in zip(features, frames)]

    def batch(self, waveforms: torch.Tensor) -> torch.Tensor:
        """Features [rows, mel_bins, frames] of equally long stretches [rows, samples] on the device, each row
        floored 8 below its own maximum (as the library does for each audio of a batch)."""
        half = self.n_fft // 2
        padded = F.pad(waveforms[:, None], (half, half), mode="reflect")[:, 0]
        return self._log_spectra(padded, [waveforms.shape[1] // self.hop] * waveforms.shape[0])

    def _log_spectra(self, padded: torch.Tensor, frames: list[int]) -> torch.Tensor:
        """[rows, mel_bins, max(frames)] from reflect-padded rows [rows, samples]: row i's first `frames[i]` frames
        are its features; its floor is 8 below its own maximum over them."""
        width = max(frames)
        stft = torch.stft(padded, self.n_fft, self.hop, window=self.window, center=False, return_complex=True)
        magnitudes = (stft[..., :width].abs() ** 2).contiguous()
        log_spec = torch.clamp(self.filters.T @ magnitudes, min=1e-10).log10()
        if min(frames) < width:  # the shorter rows' padding frames stay out of their maximum
            valid = to_device(torch.arange(width)[None] < torch.tensor(frames)[:, None], padded.device)
            peak = log_spec.masked_fill(~valid[:, None], -math.inf).amax(dim=(1, 2), keepdim=True)
        else:
            peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0


def encode(tower, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """Audio-encoder outputs [tokens, hidden] for stretches of log-mel `features` [mel_bins, frames], each its own
    attention window, in one pass of the library's encoder `tower` (it takes several audios at once: its
    convolutions run on zero-padded 1 s chunks either way, and attention stays within each audio)."""
    feats = torch.cat(features, dim=1).to(device=tower.device, dtype=tower.dtype)
    lengths = torch.tensor([f.shape[1] for f in features], device=tower.device)
    out = tower(feats, feature_lens=lengths, return_dict=True).last_hidden_state
    return list(out.split([token_count(f.shape[1], tower.n_window) for f in features]))


def token_count(frames: int, n_window: int = 50) -> int:
    """Audio tokens the encoder makes from `frames` mel frames (13 per second)."""
    chunk = n_window * 2
    rest = frames % chunk
    partial = ((((rest - 1) // 2 + 1) - 1) // 2 + 1 - 1) // 2 + 1 if rest else 0
    return partial + frames // chunk * 13


CHUNK_BUCKETS = (1, 2, 4, 8, 16)  # fixed-shape passes of this many 1 s chunks; a longer stretch takes `encode`


class AudioEncoder:
    """The library's audio encoder (its weights and modules) run at fixed shapes, one `CapturedStep` per bucket
    of chunks, with the same outputs as `encode`.

    A pass over C chunks always has the same shapes: every chunk is zero-padded to a whole chunk (the padding is
    what the convolutions' own zero padding reads, so valid outputs do not change), every chunk keeps all its token
    slots, and attention is one call over all of them under a mask that allows what the library's windows allow:
    the same audio, the same inference window (8 chunks), valid tokens only. The valid tokens are picked out after
    the step."""

    def __init__(self, tower, graphs: bool, buckets: tuple[int, ...] = CHUNK_BUCKETS) -> None:
        self.tower = tower
        self.chunk_frames = tower.n_window * 2
        self.chunk_tokens = token_count(self.chunk_frames, tower.n_window)
        self.window_chunks = tower.n_window_infer // self.chunk_frames
        self.device, self.dtype = tower.device, tower.dtype
        pool = torch.cuda.graph_pool_handle() if graphs else None  # buckets never run at once (see CapturedStep)
        self.steps = {chunks: CapturedStep(
            self._forward, torch.zeros(chunks, tower.num_mel_bins, self.chunk_frames, dtype=self.dtype,
                                       device=self.device),
            torch.zeros(chunks * self.chunk_tokens, dtype=torch.long, device=self.device), graph=graphs, pool=pool)
            for chunks in buckets}

    def __call__(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs [tokens, hidden] for stretches of log-mel `features` [mel_bins, frames], as `encode`. Stretches
        that together have more chunks than the largest bucket (many callers' turn ends in one round) go in
        several passes of whole stretches; only a stretch longer than the largest bucket by itself takes `encode`
        (eager, at shapes of its own: the first time a shape comes, it can cost hundreds of ms on a GPU)."""
        largest = max(self.steps)
        out: list[torch.Tensor] = []
        group: list[torch.Tensor] = []
        for f in features:
            chunks = math.ceil(f.shape[1] / self.chunk_frames)
            if chunks > largest:
                out += self._pass(group) + encode(self.tower, [f])
                group = []
            elif self._chunks(group) + chunks > largest:
                out += self._pass(group)
                group = [f]
            else:
                group.append(f)
        return out + self._pass(group)

    def _chunks(self, features: list[torch.Tensor]) -> int:
        return sum(math.ceil(f.shape[1] / self.chunk_frames) for f in features)

    def _pass(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """One fixed-shape pass over stretches that fit the largest bucket together."""
        if not features:
            return []
        bucket = min(size for size in self.steps if size >= self._chunks(features))
        padded, windows, keep = (to_device(x, self.device) for x in self._layout(features, bucket))
        out = self.steps[bucket](padded.to(self.dtype), windows)
        out = out.index_select(0, keep)  # a copy: the step's output is overwritten by the next pass
        return list(out.split([token_count(f.shape[1], self.tower.n_window) for f in features]))

    def _layout(self, features: list[torch.Tensor], bucket: int) -> tuple[torch.Tensor, ...]:
        """The step's inputs: the chunks [bucket, mel_bins, chunk_frames], zero-padded; each token slot's
        attention window (-1: padding); and the indices of the valid token slots, in order."""
        padded = torch.zeros(bucket, features[0].shape[0], self.chunk_frames, dtype=features[0].dtype,
                             device=features[0].device)
        windows = torch.full((bucket, self.chunk_tokens), -1, dtype=torch.long)
        chunk = window = 0
        for f in features:
            pieces = f.split(self.chunk_frames, dim=1)
            for i, piece in enumerate(pieces):
                padded[chunk, :, :piece.shape[1]] = piece
                windows[chunk, :token_count(piece.shape[1], self.tower.n_window)] = window + i // self.window_chunks
                chunk += 1
            window += math.ceil(len(pieces) / self.window_chunks)
        windows = windows.flatten()
        return padded, windows, (windows >= 0).nonzero().squeeze(1)

    def _forward(self, chunks: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """All token slots' outputs [chunks x chunk_tokens, output_dim], as the library's encoder computes them."""
        tower = self.tower
        x = chunks.unsqueeze(1)
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):
            x = F.gelu(conv(x))
        count, channels, bins, tokens = x.shape
        x = tower.conv_out(x.permute(0, 3, 1, 2).reshape(count, tokens, channels * bins))
        x = (x + tower.positional_embedding.positional_embedding[:tokens].to(x.dtype)).reshape(count * tokens, -1)
        mask = windows[:, None] == windows[None, :]  # padding slots attend among themselves, and are dropped
        for layer in tower.layers:
            x = x + _attention(layer.self_attn, layer.self_attn_layer_norm(x), mask)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
            if x.dtype == torch.float16:  # as the library's layer does
                limit = torch.finfo(x.dtype).max - 1000
                x = x.clamp(-limit, limit)
        return tower.proj2(tower.act(tower.proj1(tower.ln_post(x))))


def _attention(attn, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The encoder layer's self-attention (`Qwen3OmniMoeAudioAttention`) over all tokens under `mask`."""
    tokens = x.shape[0]
    q, k, v = (proj(x).view(1, tokens, attn.num_heads, -1).transpose(1, 2)  # [1, heads, tokens, head_dim]
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    with sdpa_kernel(LONG_PREFILL_BACKENDS):  # (the fused kernels take 4-D inputs only)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    return attn.out_proj(out.transpose(1, 2).reshape(tokens, -1))
