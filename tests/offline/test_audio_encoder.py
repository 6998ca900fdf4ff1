"""The fixed-shape audio encoder (the GPU's graphed one, run eagerly here) gives the library encoder's outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import caller_audio, engine_for

from rtc_agent.engine.step import audio_input
from studies.checks import audio_encoder as check_audio_encoder

# Mel frames per stretch (100 a second): a pause's short piece, whole and partial chunks, several callers' audio in
# one pass, 10 s (two of the model's 8 s attention windows), more chunks than the largest bucket in all (two
# passes: 18 s of two callers, 20 callers' second each), and one stretch longer than the largest bucket between
# short ones (the library's encoder for it alone).
TOLERANCE = 2e-6  # float32 on the CPU; the outputs are about 0.4 at most
PASSES = [[37], [100], [250, 37, 163], [1000], [1000, 3, 420], [900, 900], [100] * 20, [37, 1700, 50, 1500]]


@pytest.mark.parametrize("frames", PASSES, ids=lambda f: "+".join(map(str, f)))
def test_fixed_shape_encoder_equals_the_library_encoder(frames: list[int]) -> None:
    engine = engine_for()
    tower = engine.model.thinker.model.audio_tower
    seconds = sum(frames) / 100 + 0.1
    mel = audio_input.log_mel(engine.feature_extractor, caller_audio(seconds, seed=len(frames)))
    starts = np.cumsum([0, *frames])
    features = [mel[:, a:b] for a, b in zip(starts, starts[1:])]
    with torch.inference_mode():
        expected = audio_input.encode(tower, features)
        got = engine.audio_encoder(features)
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert [g.shape[0] for g in got] == [audio_input.token_count(n) for n in frames]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("samples", [400, 4_321, 16_000, 31_999, 132_480])
def test_the_engines_log_mel_equals_the_librarys(samples: int) -> None:
    """The engine makes the features on its device (audio_input.LogMel); on the CPU they are the library's bit for
    bit, whatever the stretch's length (a partial hop at the end included)."""
    engine = engine_for()
    audio = caller_audio(samples / 16_000, seed=samples)[:samples]
    assert len(audio) == samples
    expected, got = audio_input.log_mel(engine.feature_extractor, audio), engine.log_mel(audio)
    assert got.shape == expected.shape == (engine.feature_extractor.feature_size, samples // 160)
    assert torch.equal(got, expected)


def test_the_comparison_tells_one_8_s_window_from_two() -> None:
    """The tolerance above is tight enough to see a wrong window: 10 s encoded in one window instead of the
    model's 8 s + 2 s differs from the library's outputs (by about 3e-4 on the tiny model; the right layout by
    2e-7)."""
    engine = engine_for()
    tower = engine.model.thinker.model.audio_tower
    features = [audio_input.log_mel(engine.feature_extractor, caller_audio(10.1, seed=1))[:, :1000]]
    wrong = audio_input.AudioEncoder(tower, graphs=False)
    wrong.window_chunks = 100
    with torch.inference_mode():
        expected, got = audio_input.encode(tower, features)[0], wrong(features)[0]
    assert (got - expected).abs().max() > 10 * TOLERANCE


def test_the_gpu_check_runs_and_passes_on_the_cpu() -> None:
    result = check_audio_encoder.check(torch.device("cpu"), "tiny", min_cosine=0.999)
    assert result["passed"] and len(result["passes"]) == len(check_audio_encoder.PASSES)


def test_a_rounds_log_mel_of_several_stretches_equals_each_made_alone() -> None:
    """The audio stage of a round makes the features of every caller's stretch in one batch (`LogMel.many`): each
    equals its own features, the shorter stretches' frames past their own end left out of their frames and of
    their floor (the second stretch is quiet but for its last 100 samples, which only a frame past its end
    covers: counted in, they would raise its floor)."""
    engine = engine_for()
    tail_loud = 0.001 * caller_audio(0.35, seed=2)[:5_599]
    tail_loud[-100:] *= 1000
    stretches = [caller_audio(1.0, seed=1), tail_loud, caller_audio(0.5, seed=3)]
    together = engine.log_mel.many(stretches)
    for stretch, features in zip(stretches, together):
        alone = audio_input.log_mel(engine.feature_extractor, stretch)
        assert features.shape == alone.shape
        torch.testing.assert_close(features, alone, rtol=0, atol=1e-6)
