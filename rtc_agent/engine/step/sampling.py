"""Token choice for the Thinker, the Talker and the code predictor, in transformers' order of logits processors
(repetition penalty, suppressed tokens, temperature, top-k, top-p) so that greedy runs match stock `generate`."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..model.kernels.triton_support import tl, triton


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
    return gumbel_from_uniform(torch.rand(shape, generator=generator, device=device))


def gumbel_rows(generators: list[torch.Generator | None], size: int, device: torch.device) -> torch.Tensor:
    """Gumbel noise [rows, size], row i drawn with `generators[i]`, zeros where that is None (a greedy row, or one
    sitting the step out: its argmax is then the greedy one). The values of `gumbel_noise` row by row, in fewer
    kernels (a frame draws for every row): one uniform draw per drawn row, the transform once for all of them."""
    drawn = [g for g in generators if g is not None]
    if not drawn:
        return torch.zeros(len(generators), size, device=device)
    noise = gumbel_from_uniform(torch.stack([torch.rand(size, generator=g, device=device) for g in drawn]))
    if len(drawn) == len(generators):
        return noise
    rows, zeros = iter(noise.unbind(0)), noise.new_zeros(size)
    return torch.stack([next(rows) if g is not None else zeros for g in generators])


def draw_groups(samplings: list[Sampling], drawn: list[bool]) -> dict[Sampling, list[int]]:
    """Rows drawn together, under the settings they share: rows whose settings differ only in `greedy` are one
    group, drawn as sampled where any of its rows is `drawn` (a row that is not gets zero noise, and the argmax
    survives every cut), else as greedy."""
    groups: dict[Sampling, list[int]] = {}
    for i, sampling in enumerate(samplings):
        groups.setdefault(replace(sampling, greedy=False), []).append(i)
    return {shared if any(drawn[i] for i in members) else replace(shared, greedy=True): members
            for shared, members in groups.items()}


def gumbel_from_uniform(uniform: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform.clamp_(min=1e-20)))


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
           noise: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """Pick one token id per row of `logits` [rows, vocab]; returns a LongTensor [rows] on the logits' device.

    `seen` and `suppress` as in `penalised_scores`. Sampling draws through the Gumbel-max trick, so it is free of
    host synchronisation and can run inside a CUDA graph when `noise` (from `gumbel_noise`) is given instead of
    `generator`. `fused`: draw with `sample_triton` (one kernel) where it pays: a top-p cut (top-k alone is four
    kernels anyway), on CUDA with Triton, vocabularies up to `FUSED_MAX_VOCAB`."""
    scores = penalised_scores(logits, sampling, seen, suppress)
    if sampling.greedy:
        return scores.argmax(dim=-1)
    if noise is None:
        noise = gumbel_noise(scores.shape, generator, scores.device)
    if (fused_active(fused, scores.device) and sampling.top_p < 1.0 and scores.shape[-1] <= FUSED_MAX_VOCAB
            and noise.shape[-1] == scores.shape[-1]):
        return sample_triton(scores, sampling, noise)
    return sample_torch(scores, sampling, noise)


def noise_width(sampling: Sampling, vocab: int) -> int:
    """How many Gumbel values one row's draw takes: one per top-k candidate where a top-k cut leaves fewer than
    `vocab` (`sample_torch` then draws among the candidates), else one per token."""
    return min(sampling.top_k, vocab) if sampling.top_k else vocab


def sample_torch(scores: torch.Tensor, sampling: Sampling, noise: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, top-p (transformers' order), then argmax(scores + Gumbel noise).

    `noise` is [rows, vocab], or [rows, top_k] (`noise_width`) where top-k cuts: then only the top-k candidates
    are scored, cut and drawn from, the same distribution as drawing over the whole vocabulary with the rest at
    -inf (the one difference: scores tied with the k-th beyond k are not candidates). Why: on the Thinker's 152k
    vocabulary the vocabulary-wide noise, masks and sums were 40-50 % of a batched CPU decode step.

    The top-p cut keeps every score at or above the lowest one of the smallest sorted prefix reaching top_p (as
    `sample_triton` does; transformers' scatter by sort order differs only among scores tied at that boundary).
    After a top-k cut the prefix is within top-k's own sorted values, so the whole vocabulary is not sorted (152k
    scores: 16 ms on a CPU core when they are all finite, about 0.5 ms once a top-k cut has made them -inf)."""
    if sampling.top_k and noise.shape[-1] == noise_width(sampling, scores.shape[-1]) < scores.shape[-1]:
        ordered, candidates = torch.topk(scores, noise.shape[-1], dim=-1)
        ordered = ordered / sampling.temperature  # (a positive scale keeps the order)
        if sampling.top_p < 1.0:
            ordered = ordered.masked_fill(ordered < top_p_floor(ordered, ordered, sampling.top_p), float("-inf"))
        return candidates.gather(-1, (ordered + noise).argmax(dim=-1, keepdim=True)).squeeze(-1)
    scores = scores / sampling.temperature
    ordered = None
    if sampling.top_k:
        ordered = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values
        scores = scores.masked_fill(scores < ordered[..., -1:], float("-inf"))
    if sampling.top_p < 1.0:
        if ordered is None:
            ordered = torch.sort(scores, descending=True).values
        scores = scores.masked_fill(scores < top_p_floor(ordered, scores, sampling.top_p), float("-inf"))
    return (scores + noise).argmax(dim=-1)


def top_p_floor(ordered: torch.Tensor, kept: torch.Tensor, top_p: float) -> torch.Tensor:
    """The lowest score [rows, 1] that a top-p cut keeps: `ordered` holds the highest of the `kept` scores in
    descending order, at least those of the smallest prefix whose probability (over all of `kept`, ties with the
    k-th score too) reaches `top_p`."""
    probs = (ordered - kept.logsumexp(dim=-1, keepdim=True)).exp()
    drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix reaching top_p
    return ordered.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)


FUSED_MAX_VOCAB = 8192  # the code predictor's 2048 codes; the Thinker's 152k keep `sample_torch`


def sample_triton(scores: torch.Tensor, sampling: Sampling, noise: torch.Tensor) -> torch.Tensor:
    """`sample_torch` in one kernel, one program per row, one sort (why: on a 2048-code row its topk, softmax,
    cumsum and masks are several kernels each, about 110 us of each code-predictor step on the H200). The kept set
    is the same: ties at the top-p boundary all stay in both."""
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.long, device=scores.device)
    block = triton.next_power_of_2(vocab)
    _KERNEL[(rows,)](scores.contiguous(), noise.expand(rows, vocab).contiguous(), out, vocab,
                     sampling.temperature, sampling.top_p, K=min(sampling.top_k, vocab), BLOCK=block,
                     TOP_P=sampling.top_p < 1.0, num_warps=4 if block <= 2048 else 8)
    return out


def fused_active(enabled: bool, device: torch.device) -> bool:
    """Whether draws on `device` take `sample_triton` when `enabled`."""
    return enabled and device.type == "cuda" and _KERNEL is not None


_KERNEL = None  # where Triton is installed
if triton is not None:
    @triton.jit
    def sample_kernel(scores_ptr, noise_ptr, out_ptr, vocab, temperature, top_p, K: tl.constexpr,
                      BLOCK: tl.constexpr, TOP_P: tl.constexpr):
        """One row: scores / temperature; the top-K threshold (ties to the K-th score kept, as `masked_fill(scores
        < kth)` keeps them); the top-p threshold from the sorted kept scores (softmax, cumulative sum, keep the
        smallest prefix reaching top_p); argmax of the kept scores plus the noise."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < vocab
        x = tl.load(scores_ptr + row * vocab + offs, mask=ok, other=float("-inf")) / temperature
        ordered = tl.sort(x, 0, descending=True)
        if K > 0:
            kth = tl.max(tl.where(offs == K - 1, ordered, float("-inf")), 0)
            x = tl.where(x < kth, float("-inf"), x)
            ordered = tl.where(ordered < kth, float("-inf"), ordered)  # still in order: the cut is a suffix
        if TOP_P:
            weights = tl.exp(ordered - tl.max(ordered, 0))
            probs = weights / tl.sum(weights, 0)
            drop = tl.cumsum(probs, 0) - probs > top_p
            lowest_kept = tl.min(tl.where(drop, float("inf"), ordered), 0)
            x = tl.where(x < lowest_kept, float("-inf"), x)
        noise = tl.load(noise_ptr + row * vocab + offs, mask=ok, other=0.0)
        tl.store(out_ptr + row, tl.argmax(x + noise, 0).to(tl.int64))

    _KERNEL = sample_kernel
