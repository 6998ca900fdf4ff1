"""studies/turn_features.py (the offline turn-taking study's prosodic evidence) on signals whose pitch and level
are known: a voice-like pulse train gliding in pitch, fading or not, then silence."""
from __future__ import annotations

import numpy as np
import pytest

from studies.turn_features import RATE, evidence


def voice(f0_start: float, f0_end: float, seconds: float, fade_s: float = 0.0, silence_ms: int = 200) -> np.ndarray:
    """A pulse train (rich in harmonics, as a voice is) whose pitch glides from f0_start to f0_end over its last
    second (steady at f0_start before), the last `fade_s` fading to -30 dB, then `silence_ms` of zeros."""
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    f0 = np.where(t < seconds - 1, f0_start,
                  f0_start * (f0_end / f0_start) ** np.clip(t - (seconds - 1), 0, 1))
    phase = np.cumsum(f0) / RATE
    x = 0.3 * (np.sin(2 * np.pi * phase) + 0.5 * np.sin(4 * np.pi * phase) + 0.3 * np.sin(6 * np.pi * phase))
    if fade_s:
        k = int(fade_s * RATE)
        x[-k:] *= np.logspace(0, -1.5, k)
    return np.concatenate([x, np.zeros(silence_ms * RATE // 1000)]).astype(np.float32)


@pytest.mark.parametrize("f0_end, sign", [(80.0, -1), (180.0, 1)])
def test_a_final_fall_and_a_continuation_rise_have_the_sign_of_their_glide(f0_end: float, sign: int) -> None:
    e = evidence(voice(120.0, f0_end, 2.0), silence_ms=200)
    assert e is not None
    assert sign * e.pitch_end_st > 2, e  # 120 -> 80 Hz is -7 semitones at the end, 120 -> 180 Hz +7
    assert sign * e.pitch_slope_st_s > 3, e


def test_a_flat_pitch_reads_flat_and_the_speech_length_is_counted() -> None:
    e = evidence(voice(150.0, 150.0, 1.5), silence_ms=200)
    assert e is not None
    assert abs(e.pitch_end_st) < 0.5 and abs(e.pitch_slope_st_s) < 1, e
    assert 1400 <= e.speech_ms <= 1500, e


def test_a_fading_end_has_a_lower_tail_than_a_steady_one() -> None:
    steady, fading = evidence(voice(120.0, 120.0, 2.0), 200), evidence(voice(120.0, 120.0, 2.0, fade_s=0.3), 200)
    assert steady is not None and fading is not None
    assert abs(steady.tail_db) < 3 and abs(steady.fall_db) < 3, steady
    assert fading.tail_db < steady.tail_db - 8 and fading.fall_db < -8, fading


def test_too_little_speech_says_nothing() -> None:
    assert evidence(voice(120.0, 120.0, 0.1), silence_ms=200) is None
    assert evidence(np.zeros(RATE, np.float32), silence_ms=200) is None
