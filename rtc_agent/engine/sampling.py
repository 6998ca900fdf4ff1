"""Token choice for the Thinker, the Talker and the code predictor, in transformers' order of logits processors
(repetition penalty, suppressed tokens, temperature, top-k, top-p) so that greedy runs match stock `generate`."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k must be >= 0 and repetition_penalty > 0")


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise: argmax(log p + noise) is a sample from p (the Gumbel-max trick)."""
    uniform = torch.rand(shape, generator=generator, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(uniform))


def penalised_scores(logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None = None,
                     suppress: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 scores a greedy choice takes the argmax of: the repetition penalty on `seen` ids (bool, like
    `logits`), then -inf on `suppress`ed ones (bool, broadcastable)."""
    scores = logits.float()
    if seen is not None and sampling.repetition_penalty != 1.0:
        penalised = torch.where(scores < 0, scores * sampling.repetition_penalty, scores / sampling.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if suppress is not None:
        scores = scores.masked_fill(suppress, float("-inf"))
    return scores


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None,
           seen: torch.Tensor | None = None, suppress: torch.Tensor | None = None,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token id per row of `logits` [rows, vocab]; returns a LongTensor [rows] on the logits' device.

    `seen` and `suppress` as in `penalised_scores`. Sampling draws through the Gumbel-max trick, so it is free of host synchronisation and
    can run inside a CUDA graph when `noise` (from `gumbel_noise`) is given instead of `generator`."""
    scores = penalised_scores(logits, sampling, seen, suppress)
    if sampling.greedy:
        return scores.argmax(dim=-1)
    scores = scores / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_scores.softmax(dim=-1) > sampling.top_p  # keep the smallest set reaching top_p
        scores = scores.scatter(1, order, sorted_scores.masked_fill(drop, float("-inf")))
    if noise is None:
        noise = gumbel_noise(scores.shape, generator, scores.device)
    return (scores + noise).argmax(dim=-1)
