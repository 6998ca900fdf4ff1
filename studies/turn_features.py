"""What the audio of a turn says about its end besides Smart Turn's one number: cheap prosodic evidence, computed
in numpy from the turn's audio (16 kHz mono float32, as SemanticTurn holds it) at a check, 1.5-5 ms each.
For the offline study only (studies/turn_tuning.py, studies/turn_evidence.py): no policy built on it did better
than semantic_vad's auto on held-out speech, so the server does not use it (docs/turn-taking.md, "What was
tried").

- `tail_db`: the level of the last 200 ms of speech against the utterance's loud level (P90 of its 20 ms
  frames); a sentence end trails off, a word cut by a pause less so.
- `fall_db`: the last 200 ms of speech against the 400 ms before them.
- `pitch_end_st`: the median pitch of the last 300 ms of voiced speech against the utterance's median pitch, in
  semitones (a final fall is negative, a continuation rise positive).
- `pitch_slope_st_s`: the slope of the pitch over the last 500 ms of voiced speech, semitones a second.
- `speech_ms`: how much of the turn so far is speech (20 ms frames above the utterance's level - 35 dB).

Pitch is a normalized autocorrelation of 40 ms Hann windows every 20 ms (60-400 Hz), corrected for the window's
own autocorrelation; a frame is voiced where its peak is >= VOICED and it is within 25 dB of the loud level.
"""
from __future__ import annotations

import dataclasses

import numpy as np

RATE = 16_000
FRAME = RATE // 50  # 20 ms
WINDOW = 2 * FRAME  # 40 ms pitch windows
LAGS = (RATE // 400, RATE // 60)  # 400-60 Hz
VOICED = 0.5
QUIET_DB = -60.0  # a turn whose loud level (P90 of its frames) is below this has no speech to judge
_HANN = np.hanning(WINDOW).astype(np.float32)
_HANN_AC = np.fft.irfft(np.abs(np.fft.rfft(_HANN, 2 * WINDOW)) ** 2)[:LAGS[1] + 1]
_HANN_AC /= _HANN_AC[0]


@dataclasses.dataclass(frozen=True)
class Evidence:
    tail_db: float
    fall_db: float
    pitch_end_st: float
    pitch_slope_st_s: float
    speech_ms: float


def _frames_db(x: np.ndarray) -> np.ndarray:
    frames = x[:len(x) // FRAME * FRAME].reshape(-1, FRAME)
    return 10 * np.log10(np.mean(frames * frames, axis=1) + 1e-10)


def _pitch(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(f0 in Hz, voicing strength) for each 20 ms frame of `x` (the window starting at that frame)."""
    n = (len(x) - WINDOW) // FRAME + 1
    if n <= 0:
        return np.zeros(0), np.zeros(0)
    windows = np.lib.stride_tricks.sliding_window_view(x, WINDOW)[::FRAME][:n] * _HANN
    windows = windows - windows.mean(axis=1, keepdims=True) * _HANN
    ac = np.fft.irfft(np.abs(np.fft.rfft(windows, 2 * WINDOW, axis=1)) ** 2, axis=1)[:, :LAGS[1] + 1]
    ac = ac / np.maximum(ac[:, :1], 1e-12) / _HANN_AC
    lag = LAGS[0] + np.argmax(ac[:, LAGS[0]:], axis=1)
    return RATE / lag, ac[np.arange(n), lag]


def evidence(audio: np.ndarray, silence_ms: int) -> Evidence | None:
    """The evidence for the turn whose audio is `audio`, `silence_ms` of it the silence so far; None where there
    is too little speech (under 200 ms, or nothing above QUIET_DB) to say anything."""
    x = np.asarray(audio, np.float32)[:max(0, len(audio) - silence_ms * RATE // 1000)]
    db = _frames_db(x)
    if len(db) < 10:
        return None
    loud = float(np.percentile(db, 90))
    active = np.flatnonzero(db > loud - 35)
    if loud < QUIET_DB or len(active) < 10:
        return None
    last = int(active[-1]) + 1  # frames up to the last one with speech
    tail = db[max(0, last - 10):last]
    before = db[max(0, last - 30):max(0, last - 10)]
    f0, strength = _pitch(x[:last * FRAME])
    voiced = np.flatnonzero((strength >= VOICED) & (db[:len(f0)] > loud - 25))
    pitch_end = pitch_slope = 0.0
    if len(voiced) >= 5:
        st = 12 * np.log2(f0[voiced] / np.median(f0[voiced]))
        end = voiced >= voiced[-1] - 15  # the last 300 ms of voiced speech
        pitch_end = float(np.median(st[end]))
        recent = voiced >= voiced[-1] - 25  # the last 500 ms
        if recent.sum() >= 3:
            pitch_slope = float(np.polyfit(voiced[recent] * FRAME / RATE, st[recent], 1)[0])
    return Evidence(tail_db=float(tail.mean() - loud),
                    fall_db=float(tail.mean() - before.mean()) if len(before) else 0.0,
                    pitch_end_st=pitch_end, pitch_slope_st_s=pitch_slope, speech_ms=len(active) * 20.0)
