#!/usr/bin/env python3
"""How Smart Turn's verdicts on one recording move with the 32 ms chunk phase (docs/turn-taking.md, "What was
tried"): the WAV replayed through silero and the server's TurnDetector with 0, 64, ... 448 samples of silence in
front, and at 64, 128 and 192 ms of its final silence the end-of-turn model's P(complete) (`*`: semantic_vad
`auto` ends the turn there).

    .venv/bin/python -m studies.turn_phase .whl/question.wav      # any rate: resampled to 16 kHz with PyAV
"""
from __future__ import annotations

import argparse

import av
import numpy as np

from rtc_agent.config import TurnSettings
from rtc_agent.media.end_of_turn import EAGERNESS, RATE, EndOfTurnModel
from rtc_agent.media.vad import CHUNK_SAMPLES, SpeechProbability, TurnDetector

CHECKS_MS = (64, 128, 192)


def read_16k(path: str) -> np.ndarray:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    with av.open(path) as container:
        frames = [f for frame in container.decode(audio=0) for f in resampler.resample(frame)]
    frames += resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32)


def final_verdicts(speech: np.ndarray, lead: int, model: EndOfTurnModel, vad: SpeechProbability) -> dict[int, float]:
    """P(complete) at each of CHECKS_MS into the last silence of `speech` played with `lead` samples in front."""
    settings = TurnSettings()
    vad.reset()
    detector = TurnDetector(settings.vad_threshold, 10_000, settings.min_speech_ms)
    audio = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(RATE, np.float32)])
    verdicts: dict[int, float] = {}
    for end in range(CHUNK_SAMPLES, len(audio) + 1, CHUNK_SAMPLES):
        detector.feed(vad(audio[end - CHUNK_SAMPLES:end]))
        silence = detector.silence_run_ms if detector.confirmed else 0
        if silence == CHUNK_SAMPLES * 1000 // RATE:
            verdicts = {}  # a new silence: only the last one counts
        if silence in CHECKS_MS:
            verdicts[silence] = model(audio[:end])
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wav")
    args = parser.parse_args()
    speech, model, vad, auto = read_16k(args.wav), EndOfTurnModel(), SpeechProbability(), EAGERNESS["auto"]
    print("lead  " + "  ".join(f"{ms:>5} ms" for ms in CHECKS_MS))
    for lead in range(0, CHUNK_SAMPLES, 64):
        verdicts = final_verdicts(speech, lead, model, vad)
        print(f"{lead:>4}  " + "  ".join(
            (f"{verdicts[ms]:.3f}{'*' if auto.ends_turn([verdicts[ms]], ms) else ' '}  " if ms in verdicts
             else "    –    ")
            for ms in CHECKS_MS))


if __name__ == "__main__":
    main()
