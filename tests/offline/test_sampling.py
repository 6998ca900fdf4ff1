"""The fused draw (rtc_agent/engine/step/sampling.py, `sample_triton`) picks what `sample_torch` picks: the same
temperature, top-k and top-p cuts and the same Gumbel-max draw, for the Talker's and the code predictor's
vocabularies. The kernel runs on the CPU under Triton's interpreter (on short rows: it sorts slowly there)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from rtc_agent.engine.step.sampling import Sampling, choose, gumbel_noise, gumbel_rows, noise_width, sample_torch

SETTINGS = (Sampling(temperature=1.0, top_k=50, top_p=0.8), Sampling(temperature=0.9, top_k=50),
            Sampling(temperature=0.7, top_p=0.5), Sampling(temperature=1.3))


def test_torch_draw_keeps_only_the_cut_set():
    """With top-k 3 the draw never leaves the 3 best; with top-p it never leaves the smallest set reaching p."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.tensor([[4.0, 3.0, 2.9, 1.0, 0.5, -2.0]])
    top3 = {int(sample_torch(scores, Sampling(top_k=3), gumbel_noise((1, 6), generator, scores.device)))
            for _ in range(300)}
    assert top3 == {0, 1, 2}
    probs = scores.softmax(-1)[0]  # 0.56, 0.21, 0.19, ...: 0.6 needs the two best
    assert probs[0] < 0.6 < probs[0] + probs[1]
    top_p = {int(sample_torch(scores, Sampling(top_p=0.6), gumbel_noise((1, 6), generator, scores.device)))
             for _ in range(300)}
    assert top_p == {0, 1}


def test_a_draw_among_the_top_k_candidates_is_the_vocabulary_wide_draw_on_their_noise():
    """Drawing among the top-k candidates (noise [rows, top_k]) picks what the vocabulary-wide draw picks when the
    candidates get the noise they had there: the cuts keep the same set and the Gumbel-max sees the same values.
    Greedy rows (zero noise) keep their argmax."""
    generator = torch.Generator().manual_seed(5)
    for sampling in (Sampling(temperature=0.7, top_k=20, top_p=0.8), Sampling(temperature=0.9, top_k=50),
                     Sampling(temperature=1.2, top_k=7, top_p=0.3)):
        scores = 3.0 * torch.randn(16, 3000, generator=generator)
        noise = gumbel_noise(scores.shape, generator, scores.device)
        noise[3] = 0.0
        assert noise_width(sampling, 3000) == sampling.top_k
        candidates = torch.topk(scores, sampling.top_k, dim=-1).indices
        narrow = sample_torch(scores, sampling, noise.gather(-1, candidates))
        assert torch.equal(narrow, sample_torch(scores, sampling, noise))
        assert narrow[3] == scores[3].argmax()
    assert noise_width(Sampling(top_p=0.5), 3000) == 3000 and noise_width(Sampling(top_k=50), 30) == 30


def test_noise_of_several_rows_is_each_row_drawn_alone_with_zeros_where_nothing_is_drawn():
    """A frame's noise for every row at once (`gumbel_rows`) is what each row's own generator gives alone, and a
    row that does not draw (greedy, or sitting out) gets zeros, so its argmax stays the greedy one."""
    seeds = [3, None, 7, None]
    generators = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    rows = gumbel_rows(generators, 64, torch.device("cpu"))
    assert rows.shape == (4, 64)
    for seed, row in zip(seeds, rows):
        if seed is None:
            assert not row.any()
        else:
            assert torch.equal(row, gumbel_noise((64,), torch.Generator().manual_seed(seed), row.device))
    assert torch.equal(gumbel_rows([torch.Generator().manual_seed(3)], 64, torch.device("cpu"))[0], rows[0])
    assert not gumbel_rows([None, None], 8, torch.device("cpu")).any()


def test_fused_is_not_taken_off_cuda():
    scores = torch.randn(2, 64)
    noise = gumbel_noise((2, 64), torch.Generator().manual_seed(1), scores.device)
    assert torch.equal(choose(scores, SETTINGS[0], noise=noise, fused=True), sample_torch(scores, SETTINGS[0], noise))


_INTERPRETER_CHECK = """
import torch
from rtc_agent.engine.step import sampling
from rtc_agent.engine.step.sampling import Sampling, gumbel_noise, sample_torch, sample_triton
assert sampling._KERNEL is not None
settings = {settings}
generator = torch.Generator().manual_seed(0)
mismatches = draws = 0
for vocab in (200, 500):
    for setting in settings:
        scores = 2.0 * torch.randn(3, vocab, generator=generator)
        scores[:, vocab - 64:vocab - 1] = float("-inf")  # suppressed codes, as the Talker's
        noise = gumbel_noise((3, vocab), generator, scores.device)
        mismatches += int((sample_triton(scores, setting, noise) != sample_torch(scores, setting, noise)).sum())
        draws += 3
print(draws, mismatches)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_draw_equals_torch_draw_under_interpreter():
    code = _INTERPRETER_CHECK.format(settings=repr(SETTINGS))
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    draws, mismatches = (int(v) for v in out.stdout.split()[-2:])
    assert draws == 24 and mismatches == 0
