#!/usr/bin/env python3
"""How often a turn's speech holds a silence run of a given length before its end: the preparations a server asks
for that the caller's next words undo (0.6-0.8 more a sentence at 32 ms than at 64; docs/turn-taking.md). Each
sentence of the espeak-ng
turn-taking sets (studies/turn_speech.py) goes through silero and the server's TurnDetector (default threshold,
hysteresis as served) at several chunk phases; a run counts where speech follows it.

    .venv/bin/python -m studies.pause_runs                    # the three sets, runs of >= 32, 64 and 96 ms
    .venv/bin/python -m studies.pause_runs --sets heldout --phases 8
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from rtc_agent.config import TurnSettings
from rtc_agent.media.end_of_turn import RATE
from rtc_agent.media.vad import CHUNK_MS, CHUNK_SAMPLES, SpeechProbability, TurnDetector
from studies.turn_speech import SETS, speech_set

LENGTHS_MS = (32, 64, 96)


def pause_runs(vad: SpeechProbability, samples: np.ndarray, lead: int) -> list[int]:
    """The silence runs (ms) of a confirmed turn that speech followed, with `lead` samples of silence in front."""
    turn = TurnSettings()
    vad.reset()
    detector = TurnDetector(turn.vad_threshold, turn.silence_ms, turn.min_speech_ms, end_silence_ms=10_000)
    audio = np.concatenate([np.zeros(lead, np.float32), samples, np.zeros(RATE, np.float32)])
    runs, run = [], 0
    for at in range(0, len(audio) - CHUNK_SAMPLES + 1, CHUNK_SAMPLES):
        detector.feed(vad(audio[at:at + CHUNK_SAMPLES]))
        if detector.confirmed and detector.silence_run_ms == 0 and run:
            runs.append(run)
        run = detector.silence_run_ms if detector.confirmed else 0
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--phases", type=int, default=3, help="chunk phases per sentence (default 3)")
    args = parser.parse_args()
    vad = SpeechProbability()
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * (1 + len(LENGTHS_MS)))
    for name in args.sets:
        for sentence in speech_set(name, ["questions", "statements", "paused"], RATE):
            for phase in range(args.phases):
                runs = pause_runs(vad, sentence.samples, phase * CHUNK_SAMPLES // args.phases)
                row = counts[sentence.kind]
                row[0] += 1
                for i, length in enumerate(LENGTHS_MS, 1):
                    row[i] += sum(r >= length for r in runs)
    print("kind        turns  " + "  ".join(f">= {ms} ms / turn" for ms in LENGTHS_MS))
    for kind, (turns, *runs) in counts.items():
        print(f"{kind:<10} {turns:6}  " + "  ".join(f"{n / turns:15.2f}" for n in runs))
    print(f"(chunks of {CHUNK_MS} ms; 'paused' sentences hold a 600-1000 ms pause, which counts at every length)")


if __name__ == "__main__":
    main()
