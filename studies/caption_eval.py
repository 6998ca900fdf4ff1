#!/usr/bin/env python3
"""How well and how fast the captions of the caller's words work (media/captions.py, docs/captions.md).

    .venv/bin/python -m studies.caption_eval wer                     # WER, espeak-ng and two flite voices
    .venv/bin/python -m studies.caption_eval wer --real --table      # + the real recordings, a row per utterance
    .venv/bin/python -m studies.caption_eval live http://127.0.0.1:8080 --ab   # caption delay, heard with/without

`wer`: the held-out sentences of studies/turn_speech.py (questions and statements; nothing in the captions was
chosen on them) said by espeak-ng and flite (`apt-get install flite`), and with --real the finished recordings of
studies/real_speech.py (`--fetch` first). Each goes through the captions as a call's audio does: silero's speech
probability, the turn detector's onset and confirmation, then chunk by chunk into `Captions`, the recogniser's
threads waited for every 8 chunks (a machine with time to spare). The caption is the parts' completed transcripts.
WER: word edits / reference words, both lower-cased without punctuation, numbers as the recogniser wrote them.

`live`: `rtc-agent call URL --wav` of a WAV of the same espeak-ng sentences, 4 s apart, with --ab a second call
with --no-captions after each, alternating which goes first: the caption's delay after the end of the speech
(caption_ms: the client's clock, when the last `completed` of the turn arrived), the share of utterances over 2 s
with a delta before their end, and heard latency either way with what it is made of (the turn detector's wait
after the speech, the server's first packet).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from studies.turn_speech import Sentence, speech_set

from rtc_agent.media.captions import CaptionPool, Captions
from rtc_agent.media.moonshine import shared
from rtc_agent.media.vad import CHUNK_SAMPLES, Signal, SpeechProbability, TurnDetector
from rtc_agent.config import TurnSettings

RATE = 16_000
VOICES = ("espeak-ng", "flite:slt", "flite:rms")
COMPLETED = "conversation.item.input_audio_transcription.completed"


def normalized(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("-", " ")).split()


def edits(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[:], i
        for j, y in enumerate(b, 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (x != y))
    return row[-1]


class Timed:
    """The recogniser, with the CPU time of each transcript it makes."""

    def __init__(self) -> None:
        self.recognizer = shared()
        self.name, self.languages = self.recognizer.name, self.recognizer.languages
        self.cpu_s = 0.0

    def words(self, audio: np.ndarray, start: Any = (), stop: Any = None) -> list[str]:
        began = time.thread_time()
        try:
            return self.recognizer.words(audio, start, stop)
        finally:
            self.cpu_s += time.thread_time() - began


async def caption(sentence: Sentence, pool: CaptionPool) -> str:
    said: list[dict[str, Any]] = []
    captions = Captions(pool, lambda event: said.append(event.as_json()))
    turn = TurnSettings()
    vad, detector = SpeechProbability(), TurnDetector(turn.vad_threshold, turn.silence_ms, turn.min_speech_ms, 10_000)
    audio = np.concatenate([np.zeros(RATE // 2, np.float32), sentence.samples, np.zeros(RATE, np.float32)])
    preroll: list[np.ndarray] = []  # before the speech: kept as the conversation keeps prefix_padding_ms
    in_turn = False
    for n, at in enumerate(range(0, len(audio) - CHUNK_SAMPLES + 1, CHUNK_SAMPLES)):
        chunk = audio[at:at + CHUNK_SAMPLES]
        signal = detector.feed(vad(chunk))
        if in_turn:
            captions.add(chunk, detector.active and not detector.silence_run_ms)
        elif signal in (Signal.ONSET, Signal.CONFIRMED):
            in_turn = True
            lead = preroll[-turn.prefix_padding_ms // 32:]
            captions.begin("item", [*lead, chunk], lead_ms=len(lead) * 32)
        else:
            preroll.append(chunk)
        if signal is Signal.CONFIRMED:
            captions.confirm()
        if n % 8 == 0:
            await settle(pool)
    captions.end()
    await settle(pool)
    parts = sorted((e["content_index"], e["transcript"]) for e in said if e["type"] == COMPLETED)
    return " ".join(t for _, t in parts)


async def settle(pool: CaptionPool) -> None:
    while pool.pending():
        await asyncio.sleep(0.005)
    await asyncio.sleep(0)


def wer(args: argparse.Namespace) -> None:
    sets: list[tuple[str, list[Sentence]]] = [
        (voice, speech_set("heldout", ["questions", "statements"], RATE, voice=voice)) for voice in args.voices]
    if args.real:
        from real_speech import real_set

        sets.append(("real", real_set(["finished"], RATE)))
    timed = Timed()
    pool = CaptionPool(timed, threads=1)
    rows, summary = [], []

    async def run_all() -> None:
        for name, sentences in sets:
            errors = words = 0
            cpu_before, speech_s = timed.cpu_s, 0.0
            for s in sentences:
                heard = await caption(s, pool)
                reference = normalized(s.text)
                e = edits(reference, normalized(heard))
                errors, words, speech_s = errors + e, words + len(reference), speech_s + s.end / RATE
                rows.append((name, s.id or s.kind, s.text, heard, e, len(reference)))
            summary.append({"set": name, "utterances": len(sentences), "words": words,
                            "wer": round(errors / max(1, words), 4),
                            "cpu_ms_per_speech_s": round((timed.cpu_s - cpu_before) * 1000 / speech_s, 1)})

    asyncio.run(run_all())
    pool.close()
    if args.table:
        print("| set | utterance | said | caption | errors / words |\n|---|---|---|---|---|")
        for name, what, text, heard, e, n in rows:
            print(f"| {name} | {what} | {text} | {heard} | {e} / {n} |")
        print()
    print(json.dumps(summary, indent=1))


def live(args: argparse.Namespace) -> None:
    sentences = speech_set("heldout", ["questions", "statements"], 24_000)
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "said.wav"
        gap = np.zeros(4 * 24_000, np.float32)
        audio = np.concatenate([piece for s in sentences for piece in (s.samples, gap)])
        with wave.open(str(wav), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(24_000)
            w.writeframes((np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes())
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for n in range(args.runs):
            order = ("on", "off") if n % 2 == 0 else ("off", "on")
            for which in order if args.ab else ("on",):
                command = [args.rtc_agent, "call", args.url, "--wav", str(wav), "--json",
                           *(["--no-captions"] if which == "off" else [])]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[which] += json.loads(out.stdout)["turns"]
    said_s = [s.end / 24_000 for s in sentences]
    on = runs["on"]
    caption_ms = [t["caption_ms"] for t in on if t.get("caption_ms") is not None]
    long_turns = [t for t, s in zip(on, said_s * args.runs) if s > 2.0]
    report = {
        "turns": len(on), "captioned": len(caption_ms),
        "caption_ms_p50": percentile(caption_ms, 50), "caption_ms_p90": percentile(caption_ms, 90),
        "over_2s_with_a_delta_before_the_end": f"{sum(t['caption_deltas_before_end'] > 0 for t in long_turns)}"
                                               f"/{len(long_turns)}",
        "heard_ms_p50": {k: percentile([t["client_latency_ms"] for t in v if t["client_latency_ms"]], 50)
                         for k, v in runs.items() if v},
        "heard_ms_p90": {k: percentile([t["client_latency_ms"] for t in v if t["client_latency_ms"]], 90)
                         for k, v in runs.items() if v},
        # what heard is made of: the turn detector's wait after the speech, then the server's first packet
        "end_of_turn_wait_ms_p50": {k: percentile(server(v, lambda m: (m.get("end_of_turn") or {}).get("wait_ms")), 50)
                                    for k, v in runs.items() if v},
        "server_first_packet_ms_p50": {k: percentile(server(v, lambda m: m.get("ttfp_ms")), 50)
                                       for k, v in runs.items() if v},
    }
    if args.table:
        print("| said | caption | caption ms | deltas before the end | heard ms |\n|---|---|---|---|---|")
        for s, t in zip(sentences * args.runs, on):
            print(f"| {s.text} | {t.get('caption')} | {t.get('caption_ms')} | {t.get('caption_deltas_before_end')} "
                  f"| {t['client_latency_ms']} |")
        print()
    print(json.dumps(report, indent=1))


def server(turns: list[dict[str, Any]], field: Any) -> list[float]:
    """`field` of each turn's server metrics (response.done's), where the turn has them."""
    return [v for t in turns if t.get("server") and (v := field(t["server"])) is not None]


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wer")
    w.add_argument("--voices", nargs="+", default=list(VOICES))
    w.add_argument("--real", action="store_true",
                   help="also the real recordings (python3 -m studies.real_speech --fetch)")
    w.add_argument("--table", action="store_true", help="a markdown row per utterance")
    lv = sub.add_parser("live")
    lv.add_argument("url")
    lv.add_argument("--ab", action="store_true", help="each call again with --no-captions")
    lv.add_argument("--runs", type=int, default=2)
    lv.add_argument("--table", action="store_true")
    lv.add_argument("--rtc-agent", default=str(Path(sys.executable).with_name("rtc-agent")))
    args = parser.parse_args()
    (wer if args.command == "wer" else live)(args)


if __name__ == "__main__":
    main()
