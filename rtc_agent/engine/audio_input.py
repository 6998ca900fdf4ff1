"""Caller audio into the Thinker: validation, log-mel features, and the audio encoder.

Each encoded chunk is its own attention window (the model was trained with 1-8 s windows), so a turn can be
encoded piece by piece while the caller is still talking.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .events import INPUT_SAMPLE_RATE

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
    """Whisper log-mel features [mel_bins, frames] of one stretch of 16 kHz audio, unpadded."""
    out = feature_extractor(samples, sampling_rate=INPUT_SAMPLE_RATE, padding="longest", truncation=False,
                            return_attention_mask=True, return_tensors="pt")
    frames = int(out["attention_mask"].sum())
    return out["input_features"][0, :, :frames]


@dataclass
class AudioRequest:
    """A stretch of caller audio to encode, as a session's job hands it to the worker (`yield`): the worker
    encodes the requests of several sessions in one pass (`encode`) and sends back each one's output."""

    features: torch.Tensor  # log-mel [mel_bins, frames]


def encode(thinker, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """Audio-encoder outputs [tokens, hidden] for stretches of log-mel `features` [mel_bins, frames], each its own
    attention window, in one pass of the encoder (it takes several audios at once: its convolutions run on
    zero-padded 1 s chunks either way, and attention stays within each audio)."""
    tower = thinker.model.audio_tower
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
