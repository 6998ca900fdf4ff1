#!/usr/bin/env python3
"""What Smart Turn says as a silence goes on, offline, and how a semantic_vad policy would fare on it.

    .venv/bin/python -m studies.turn_tuning --set tuning --out tuning.json     # score every 32 ms of silence
    .venv/bin/python -m studies.turn_tuning --load tuning.json --search        # choose check times / thresholds
    .venv/bin/python -m studies.turn_tuning --set heldout --out heldout.json   # then only evaluate on held-out
    .venv/bin/python -m studies.turn_tuning --set heldout --voice flite:slt    # the same sentences, another voice
    .venv/bin/python -m studies.turn_tuning --set real --out real.json         # real speech: reporting only

Each sentence of a set (studies/turn_speech.py) goes through silero-vad and the server's TurnDetector chunk by
chunk, as in a call (16 kHz, 32 ms chunks, no Opus); at every chunk of every silence after confirmed speech the
end-of-turn model scores the turn's audio so far. A policy (media/end_of_turn.Eagerness) is then replayed on
those scores: when each verdict would come (check time + the verdict's own time) and whether it ends the turn,
in the mid-sentence pause (a cut-in) or after the real end (the wait). Each silence also keeps the prosodic
evidence of the speech before it (studies/turn_features.py; studies/turn_evidence.py fits policies on it). It also
prints a ceiling for every policy that decides early: how many questions any one threshold could end within
256 ms of silence while it keeps --floor of the pauses.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rtc_agent.config import TurnSettings
from rtc_agent.engine.step.turn_scoring import DeviceTurnModel
from rtc_agent.media import last_words
from rtc_agent.media.end_of_turn import EAGERNESS, WINDOW_S, Eagerness, EndOfTurnModel
from rtc_agent.media.vad import CHUNK_MS, CHUNK_SAMPLES, SpeechProbability, TurnDetector
from studies.turn_features import evidence
from studies.turn_speech import SETS, VOICES, Sentence, speech_set

RATE = 16_000
FINISHED = ("question", "statement", "finished")  # a whole sentence, then silence (synthetic sets; real speech)
LONGEST_MS = 1600  # scores kept after the real end
VERDICT_MS = 45  # a verdict comes this long after its check (the model's time per decision, docs/turn-taking.md)
WORDS_MS = 90  # the last words come this long after the pause's first check (last_words.py, a 2-3 s turn)


def sentences(name: str, kinds: list[str], continuation: bool, voice: str) -> list[Sentence]:
    """A synthetic set's sentences (studies/turn_speech.py), or with "real" every real clip (of every kind)."""
    if name == "real":
        from real_speech import KINDS as REAL_KINDS
        from real_speech import real_set

        return real_set(list(REAL_KINDS), RATE)
    return speech_set(name, kinds, RATE, continuation, voice)


def end_of_turn_model(scorer: str, shifts: tuple[int, ...] = (0,)) -> Callable[[np.ndarray], float]:
    """The model as the media processes run it (onnxruntime) or as the engine does (torch: on this CPU); with
    `shifts`, the mean of its verdicts on the turn less that many samples at its end (other log-mel frame grids)."""
    if scorer == "onnxruntime":
        one = EndOfTurnModel()
    else:
        model = DeviceTurnModel(torch.device("cpu"))
        one = lambda audio: model([audio])[0]  # noqa: E731
    return lambda audio: float(np.mean([one(audio[:len(audio) - shift]) for shift in shifts]))


def speech_end(audio: np.ndarray, until: int, look_back: int = RATE // 4) -> int:
    """The sample just after the last sound before `until`, to a millisecond: the last 5 ms window (1 ms hop) of
    the `look_back` samples before it whose RMS is within 35 dB of the loudest windows (95th percentile) of the
    last 8 s (`until - look_back` when none of them is)."""
    window, hop = RATE // 200, RATE // 1000
    recent = audio[max(0, until - RATE * WINDOW_S):until]
    frames = np.lib.stride_tricks.sliding_window_view(recent, window)[::hop]
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    floor = np.percentile(rms, 95) * 10 ** (-35 / 20)
    sound = np.flatnonzero(rms[-(look_back // hop):] > floor)
    if not len(sound):
        return until - look_back
    last = len(rms) - look_back // hop + sound[-1]  # the last loud window, counted in hops
    return min(until, max(0, until - len(recent)) + last * hop + window)


def trajectories(name: str, kinds: list[str], continuation: bool, voice: str,
                 scorer: str = "onnxruntime", shifts: tuple[int, ...] = (0,), cut: str = "chunk"
                 ) -> list[dict[str, Any]]:
    """`cut`: "chunk" scores the turn up to the end of the chunk at hand, as the server does; "speech-end" up to
    the last sound (`speech_end`, found when the silence begins) plus the silence run so far, so that the model
    sees the same stretch of silence, on the same log-mel frame grid, whatever the chunk phase."""
    model, vad, turn = end_of_turn_model(scorer, shifts), SpeechProbability(), TurnSettings()
    hear = last_words.shared_last_words() if last_words.installed() else None
    first_check = EAGERNESS["auto"].first_check_ms
    out = []
    for s in sentences(name, kinds, continuation, voice):
        vad.reset()
        detector = TurnDetector(turn.vad_threshold, 10_000, turn.min_speech_ms)
        audio = np.concatenate([s.samples, np.zeros(RATE * 2, np.float32)])
        silences: list[dict[str, Any]] = []
        for i in range(len(audio) // CHUNK_SAMPLES):
            end = (i + 1) * CHUNK_SAMPLES
            detector.feed(vad(audio[end - CHUNK_SAMPLES:end]))
            run = detector.silence_run_ms if detector.confirmed else 0
            if run == CHUNK_MS:  # a silence begins (as silero counts it, at the start of this chunk's run)
                heard = evidence(audio[max(0, end - RATE * WINDOW_S - CHUNK_SAMPLES):end], CHUNK_MS)
                silences.append({"begins_ms": (end - CHUNK_SAMPLES) * 1000 // RATE, "scores": [],
                                 "evidence": heard and dataclasses.asdict(heard),
                                 "sound_ends": speech_end(audio, end - CHUNK_SAMPLES) if cut == "speech-end" else None})
            if run and len(silences[-1]["scores"]) < LONGEST_MS // CHUNK_MS:
                until = end if cut == "chunk" else min(end, silences[-1]["sound_ends"] + run * RATE // 1000)
                silences[-1]["scores"].append(round(model(audio[:until]), 4))
            if run == first_check and hear is not None:  # the words as the first check hears them
                text, p = hear(audio[max(0, end - RATE * WINDOW_S):end])
                silences[-1].update(words=text, end_p=p)
        real_end_ms = s.end * 1000 // RATE
        # The final silence is the last one (it runs into the 2 s of zeros): silero may count it from a little
        # before the last faint sound (real speech: "This conference is locked!"), so it is not told by its start.
        final = silences[-1:] if silences and silences[-1]["begins_ms"] >= real_end_ms - 500 else []
        mid = silences[:len(silences) - len(final)]
        out.append({"kind": s.kind, "text": s.text, "id": s.id, "voice": s.voice or voice,
                    "vad_tail_ms": final[0]["begins_ms"] - real_end_ms if final else None,
                    "final": final[0]["scores"] if final else [], "mid": [x["scores"] for x in mid],
                    "final_words": final[0].get("words") if final else None,
                    "mid_words": [x.get("words") for x in mid],
                    "final_end_p": final[0].get("end_p") if final else None,
                    "mid_end_p": [x.get("end_p") for x in mid],
                    "final_evidence": final[0]["evidence"] if final else None,
                    "mid_evidence": [x["evidence"] for x in mid]})
        print(f"{s.text}: tail {out[-1]['vad_tail_ms']} ms, {len(mid)} pauses", file=sys.stderr)
    return out


def verdicts(scores: list[float], e: Eagerness, longest_ms: int,
             unfinished: bool | None = None) -> tuple[int | None, float | None]:
    """(silence ms when the turn would end, the deciding score) for one silence of `longest_ms` at most, with
    checks as SemanticTurn makes them (`unfinished`: the pause's last words, heard WORDS_MS after its first
    check; None: not heard); (None, None): no verdict ended it."""
    point, ends_at, asked = e.first_check_ms, 0, []
    words_at = e.first_check_ms + WORDS_MS if unfinished is not None else 0
    for i, p in enumerate(scores):
        silence = (i + 1) * CHUNK_MS
        if silence >= max(point, ends_at):  # one verdict at a time; a point passed meanwhile is asked for now
            ends_at = max(silence + VERDICT_MS, words_at)  # a verdict waits for the pause's words
            if ends_at >= longest_ms:
                break
            point = e.next_check_ms(point)
            asked.append(p)
            if e.ends_turn(asked, silence) if unfinished is None else e.ends_turn(asked, silence, unfinished):
                return ends_at, p
    return (e.max_wait_ms, None) if longest_ms >= e.max_wait_ms else (None, None)


def evaluate(rows: list[dict[str, Any]], e: Eagerness, below: float | None = None) -> dict[str, Any]:
    """Questions: speech end -> the verdict that ends the turn (VAD tail + wait); every sentence: cut in a pause
    inside it or not (a question's pauses are espeak-ng's short ones between phrases). `below`: with the last
    words (scores made with them installed), unfinished below this P(the sentence ends)."""
    def unfinished(p: float | None) -> bool | None:
        return None if below is None or p is None else p < below

    waits, cut = [], {"question": 0, "statement": 0, "finished": 0, "paused": 0, "unfinished": 0}
    for r in rows:
        end_p = r.get("mid_end_p") or [None] * len(r["mid"])
        cut[r["kind"]] += any(verdicts(m, e, len(m) * CHUNK_MS, unfinished(p))[0] is not None
                              for m, p in zip(r["mid"], end_p))
        if r["kind"] in FINISHED:
            wait, _ = verdicts(r["final"], e, 10_000, unfinished(r.get("final_end_p")))
            waits.append(r["vad_tail_ms"] + (wait if wait is not None else e.max_wait_ms))
    paused = sum(r["kind"] == "paused" for r in rows)
    return {"speech_end_to_verdict_p50_ms": float(np.percentile(waits, 50)),
            "speech_end_to_verdict_p90_ms": float(np.percentile(waits, 90)),
            "questions_cut": sum(cut[k] for k in FINISHED), "not_cut": f"{paused - cut['paused']}/{paused}",
            "not_cut_share": (paused - cut["paused"]) / paused}


def early_bound(rows: list[dict[str, Any]], floor: float, within_ms: int = 256) -> tuple[int, int, float]:
    """The most complete questions any single threshold could end within `within_ms` of silence (a verdict at every
    chunk, the best one counts) while at least `floor` of the cut sentences stay below it over as much of each
    of their pauses: (questions, of how many, the threshold). A ceiling for every policy that decides early."""
    k = within_ms // CHUNK_MS
    q = np.array([max(r["final"][:k]) for r in rows if r["kind"] in FINISHED])
    cut = np.array([max(max(m[:k]) for m in r["mid"]) if r["mid"] else 0.0 for r in rows if r["kind"] == "paused"])
    share, threshold = max(((q >= t).mean(), t) for t in np.unique(np.concatenate([q, cut, [1.01]]))
                           if (cut < t).mean() >= floor)
    return round(share * len(q)), len(q), float(threshold)


def separation(rows: list[dict[str, Any]], silence_ms: int) -> float:
    """The chance that a complete question scores above a sentence cut in its (longest) pause, both `silence_ms`
    into the silence: 0.5 when the model cannot tell them apart, 1 when it always can."""
    k = silence_ms // CHUNK_MS - 1
    q = np.array([r["final"][k] for r in rows if r["kind"] in FINISHED and len(r["final"]) > k])
    cut = np.array([max(r["mid"], key=len)[k] for r in rows
                    if r["kind"] == "paused" and r["mid"] and len(max(r["mid"], key=len)) > k])
    return float(((q[:, None] > cut[None]) + 0.5 * (q[:, None] == cut[None])).mean())


def search(rows: list[dict[str, Any]], floor: float) -> list[tuple[dict[str, Any], Eagerness]]:
    """Policies that keep at least `floor` of the pauses, fastest P50 then P90 first."""
    found = []
    for first, recheck, early_until, t0, slope, average_of in itertools.product(
            (64, 96, 128, 160, 192), (32, 64, 96, 128), (256, 384, 512, 640),
            (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95), (0.0, 0.0001, 0.0002, 0.0004), (1, 2)):
        e = dataclasses.replace(EAGERNESS["auto"], first_check_ms=first, recheck_ms=recheck, early_until_ms=early_until,
                                threshold=t0, threshold_per_ms=slope, average_of=average_of)
        r = evaluate(rows, e)
        if r["not_cut_share"] >= floor:
            found.append((r, e))
    found.sort(key=lambda f: (f[0]["speech_end_to_verdict_p50_ms"], f[0]["speech_end_to_verdict_p90_ms"]))
    return found


def search_words(rows: list[dict[str, Any]], floor: float) -> list[tuple[dict[str, Any], float, Eagerness]]:
    """auto's checks with the last words: the P(the sentence ends) below which words are unfinished, and the early
    threshold when they are not, for policies that keep at least `floor` of the pauses, fastest P50 + P90 first."""
    found = []
    for below, threshold in itertools.product((0.02, 0.03, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2),
                                              (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, None)):
        e = dataclasses.replace(EAGERNESS["auto"], finished_threshold=threshold)
        r = evaluate(rows, e, below)
        if r["not_cut_share"] >= floor:
            found.append((r, below, e))
    found.sort(key=lambda f: f[0]["speech_end_to_verdict_p50_ms"] + f[0]["speech_end_to_verdict_p90_ms"])
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=SETS + ("real",), help="score this speech set (real: studies/real_speech.py, "
                   "held out, for reporting only)")
    p.add_argument("--kinds", default="questions,paused", help="questions, statements, paused (comma-separated)")
    p.add_argument("--continuation", action="store_true", help="a comma before each mid-sentence break")
    p.add_argument("--voice", choices=VOICES, default="espeak-ng", help="the synthesizer that says the set")
    p.add_argument("--scorer", choices=("onnxruntime", "torch"), default="onnxruntime",
                   help="run the model as the media processes do (onnxruntime) or as the engine does on its GPU "
                        "(torch ops: engine/step/turn_scoring.py; here on the CPU)")
    p.add_argument("--shifts", default="0", help="score the mean of the verdicts on the turn less these many "
                   "samples at its end, comma-separated (the log-mel frame grid moves with them; 160 a frame)")
    p.add_argument("--cut", choices=("chunk", "speech-end"), default="chunk",
                   help="score the turn up to the chunk's end (as the server does) or up to its last sound plus "
                        "the silence run (the same silence on the same frame grid at every chunk phase)")
    p.add_argument("--out", help="keep the scores here (JSON)")
    p.add_argument("--load", nargs="+", help="scores made before (JSON files, taken together) instead of --set")
    p.add_argument("--search", action="store_true", help="look for the fastest policies that keep --floor")
    p.add_argument("--floor", type=float, default=0.85, help="share of pauses not cut, at least")
    args = p.parse_args()
    if args.load:
        rows = [row for path in args.load for row in json.loads(Path(path).read_text())]
    else:
        rows = trajectories(args.set, args.kinds.split(","), args.continuation, args.voice, args.scorer,
                           tuple(int(x) for x in args.shifts.split(",")), args.cut)
    if args.out:
        Path(args.out).write_text(json.dumps(rows))
    tails = [r["vad_tail_ms"] for r in rows if r["kind"] in FINISHED]
    print(f"VAD tail (last sound -> silence as silero counts it): P50 {np.percentile(tails, 50):.0f} ms, "
          f"P90 {np.percentile(tails, 90):.0f} ms")
    if not any(r["kind"] == "paused" for r in rows):
        return  # the replays below weigh finished sentences against paused ones: load both files together
    for name, e in EAGERNESS.items():
        print(name, evaluate(rows, e))
    if any(r.get("final_words") is not None for r in rows):
        for name, e in EAGERNESS.items():
            print(name, "with the last words", evaluate(rows, e, last_words.UNFINISHED_BELOW))
        if args.search:
            print("auto with the last words, fastest first among those keeping --floor of the pauses:")
            for r, below, e in search_words(rows, args.floor)[:10]:
                print(r, f"unfinished below {below}, finished_threshold {e.finished_threshold}")
    print("separation of complete from cut: " + ", ".join(f"{ms} ms {separation(rows, ms):.2f}" for ms in (128, 256)))
    ended, questions, threshold = early_bound(rows, args.floor)
    print(f"at most {ended}/{questions} questions can end within 256 ms of silence while {args.floor:.0%} of the "
          f"pauses are kept (threshold {threshold:.3f})")
    if args.search:
        for r, e in search(rows, args.floor)[:15]:
            print(r, e)


if __name__ == "__main__":
    main()
