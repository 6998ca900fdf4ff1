#!/usr/bin/env python3
"""Turn-taking measured as a caller hears it: espeak-ng questions and sentences with a pause in the middle,
spoken by the project's aiortc client to a real server, in each turn-detection mode.

    .venv/bin/python -m studies.turn_latency                      # starts `rtc-agent serve` on port 8120
    .venv/bin/python -m studies.turn_latency --speech tuning      # the sentences semantic_vad was tuned on
    .venv/bin/python -m studies.turn_latency --url http://127.0.0.1:8120 --modes semantic_vad:auto,server_vad:400
    .venv/bin/python -m studies.turn_latency --callers 8 --sets questions   # 8 calls at once
    .venv/bin/python -m studies.turn_latency --speech real        # recordings of people (studies/real_speech.py)
    .venv/bin/python -m studies.turn_latency --speech fresh --voice flite:awb   # another set, another voice

Per sentence: the end-of-turn probability and the wait chosen (response.done's `end_of_turn`), the heard latency
(end of speech in the WAV -> first answer audio arriving at the caller), and whether the turn was ended inside
the sentence's pause (a cut-in); and where the heard latency went (the check, the verdict, the server's first
packet, the rest). The speech is the held-out set of studies/turn_speech.py unless `--speech tuning`. Prints
Markdown tables and a summary; `--json FILE` keeps everything.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import numpy as np

from rtc_agent.client.microphone import RATE, Microphone
from rtc_agent.client.peer import Call
from rtc_agent.media.ice import use_host_addresses
from studies.turn_speech import SETS, VOICES, Sentence, speech_set

KINDS = ("question", "comma", "finished", "paused", "unfinished")  # real speech: finished, paused, unfinished

GAP_AFTER_S = 0.4  # quiet between one sentence's answer and the next sentence
WAIT_S = 12.0  # longest wait for a sentence's answer after its speech ends


def turn_detection(mode: str) -> dict[str, Any]:
    """"semantic_vad:auto" or "server_vad:400" -> session.update's turn_detection."""
    kind, _, arg = mode.partition(":")
    if kind == "semantic_vad":
        return {"type": kind, "eagerness": arg or "auto"}
    if kind == "server_vad":
        return {"type": kind, "silence_duration_ms": int(arg or 400)}
    raise ValueError(f"unknown mode {mode!r}")


async def speak(call: Call, mic: Microphone, sentence: Sentence) -> dict[str, Any]:
    """Plays one sentence into the call and waits until the turn after its real end is answered."""
    seen = len(call.events)
    at = mic.play(sentence.samples)
    t_end = mic.time_at(at + sentence.end)
    deadline = t_end + WAIT_S

    def mine() -> list[tuple[float, dict[str, Any]]]:
        return call.events[seen:]

    def answered() -> bool:  # the turn after the real end was committed, and every answer begun has ended
        commits = [t for t, e in mine() if e["type"] == "input_audio_buffer.committed"]
        created = [t for t, e in mine() if e["type"] == "response.created"]
        done = sum(e["type"] == "response.done" for _, e in mine())
        return bool(commits) and commits[-1] >= t_end and bool(created) and created[-1] >= commits[-1] \
            and done >= len(created)

    while not (mic.idle and answered()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    commits = [t for t, e in mine() if e["type"] == "input_audio_buffer.committed"]
    dones = [e["response"] for _, e in mine() if e["type"] == "response.done"]
    final_commit = next((t for t in commits if t >= t_end), None)
    heard = call.audio.first_sound_after(max(t_end, final_commit or t_end)) if final_commit else None
    final = dones[-1] if final_commit and dones else None
    eot = (final or {}).get("metrics", {}).get("end_of_turn", {})
    cut_in = any(t < t_end for t in commits)
    row: dict[str, Any] = {
        "kind": sentence.kind, "text": sentence.text, "id": sentence.id, "voice": sentence.voice,
        "probability": eot.get("probability"),
        "wait_ms": eot.get("wait_ms"), "decisions": eot.get("decisions"),
        "decision_cpu_ms": eot.get("decision_cpu_ms", []), "decision_threads": eot.get("decision_threads", []),
        "heard_ms": None if heard is None else round((heard - t_end) * 1000),
        "pause_ms": None if sentence.pause is None else round((sentence.pause[1] - sentence.pause[0]) * 1000 / RATE),
        "cut_in": cut_in, "answered_after_end": final_commit is not None,
        "server_ttfp_ms": (final or {}).get("metrics", {}).get("ttfp_ms"),
        "checked_at_ms": eot.get("checked_at_ms"), "verdict_ms": eot.get("verdict_ms"),
        "words": eot.get("words"), "words_ready": eot.get("words_ready"), "words_ending": eot.get("words_ending"),
        "words_wait_ms": eot.get("words_wait_ms"),
    }
    if cut_in and dones:  # what the model said, and the words it read, when it ended the turn inside the pause
        cut = dones[0]["metrics"]["end_of_turn"]
        row.update(cut_probability=cut.get("probability"), cut_words=cut.get("words"),
                   cut_words_ending=cut.get("words_ending") if cut.get("words_ready") else None)
    await asyncio.sleep(GAP_AFTER_S)
    return row


@contextlib.asynccontextmanager
async def connected(url: str, mode: str) -> AsyncIterator[tuple[Call, Microphone]]:
    mic, call = Microphone(), Call(url)
    await call.connect(mic)
    try:
        await call.next_event("session.created", timeout_s=10)
        call.send({"type": "session.update", "session": {"turn_detection": turn_detection(mode)}})
        await call.next_event("session.updated", timeout_s=10)
        mic.play(np.zeros(RATE // 2, np.float32))
        await asyncio.sleep(0.6)
        yield call, mic
    finally:
        await call.hang_up()


async def one_caller(url: str, mode: str, sentences: list[Sentence]) -> list[dict[str, Any]]:
    async with connected(url, mode) as (call, mic):
        return [await speak(call, mic, s) for s in sentences]


async def measure(url: str, modes: list[str], sentences: list[Sentence], callers: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode in modes:
        if callers == 1:
            rows = await one_caller(url, mode, sentences)
        else:  # each caller speaks the set from a different starting point
            shifted = [sentences[i * len(sentences) // callers:] + sentences[:i * len(sentences) // callers]
                       for i in range(callers)]
            per = await asyncio.gather(*(one_caller(url, mode, s) for s in shifted))
            rows = [dict(r, caller=i) for i, rs in enumerate(per) for r in rs]
        results[mode] = rows
    return results


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(values, q))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        heard = [r["heard_ms"] for r in rs if r["heard_ms"] is not None and not r["cut_in"]]
        costs = [c for r in rs for c in r["decision_cpu_ms"]]
        wide = sum(n > 1 for r in rs for n in r["decision_threads"])
        out[kind] = {
            "n": len(rs), "heard_p50_ms": pct(heard, 50), "heard_p90_ms": pct(heard, 90),
            "wait_p50_ms": pct([r["wait_ms"] for r in rs if r["wait_ms"] is not None], 50),
            "cut_in": sum(r["cut_in"] for r in rs), "not_cut_share": 1 - sum(r["cut_in"] for r in rs) / len(rs),
            "answered_after_end": sum(r["answered_after_end"] for r in rs),
            "decision_cpu_ms_p50": pct(costs, 50), "decision_cpu_ms_p90": pct(costs, 90), "decisions_wide": wide,
            "decisions_per_turn": statistics.mean(r["decisions"] or 0 for r in rs) if costs else None,
            "words_ready": sum(bool(r.get("words_ready")) for r in rs),
            "breakdown_p50_ms": breakdown([r for r in rs if r["heard_ms"] is not None and not r["cut_in"]]),
        }
    return out


def breakdown(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where a heard latency goes (P50 of each part): the silence before the deciding verdict was asked for,
    the verdict's own time, the server's first packet after the turn ended, and the rest (VAD tail: silero
    counts silence from ~30-90 ms after the last sound; the trip to the server and its 32 ms chunks; the trip
    back and the client's receiving)."""
    def p50(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return pct(values, 50)
    rest = [r["heard_ms"] - r["wait_ms"] - r["server_ttfp_ms"] for r in rows
            if r["wait_ms"] is not None and r["server_ttfp_ms"] is not None]
    return {"checked_at": p50([r.get("checked_at_ms") for r in rows]),
            "verdict": p50([r.get("verdict_ms") for r in rows]),
            "wait": p50([r["wait_ms"] for r in rows]), "server_first_packet": p50([r["server_ttfp_ms"] for r in rows]),
            "vad_tail_and_transport": p50(rest), "heard": p50([r["heard_ms"] for r in rows])}


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2f}" if v < 1.5 else f"{v:.0f}"
    return str(v)


def markdown(results: dict[str, Any]) -> str:
    lines = []
    for mode, rows in results.items():
        lines += [f"### {mode}", "", "| sentence | P(complete) | words read | wait ms | heard ms | cut in the pause |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            cut = fmt(r["cut_in"]) + (f" (at P {fmt(r['cut_probability'])})" if r.get("cut_probability") else "")
            who = f" ({r['voice']})" if r.get("voice") else ""
            read = f"{r['words']} ({r['words_ending']})" if r.get("words_ready") else "–"
            lines.append(f"| {r['text']}{who} | {fmt(r['probability'])} | {read} | {fmt(r['wait_ms'])} | "
                         f"{fmt(r['heard_ms'])} "
                         f"| {cut if r['kind'] != 'question' else fmt(r['cut_in'])} |")
        lines.append("")
        for kind, s in summary(rows).items():
            lines.append(f"- {kind}s ({s['n']}): heard P50 {fmt(s['heard_p50_ms'])} ms, "
                         f"P90 {fmt(s['heard_p90_ms'])} ms (not cut in); wait P50 {fmt(s['wait_p50_ms'])} ms; "
                         f"not cut in: {s['n'] - s['cut_in']}/{s['n']}"
                         f"; answered after the real end: {s['answered_after_end']}/{s['n']}; end-of-turn model "
                         f"{fmt(s['decision_cpu_ms_p50'])} ms CPU a decision on its scoring thread (P90 "
                         f"{fmt(s['decision_cpu_ms_p90'])}; {s['decisions_wide']} of them on two threads, the "
                         "second's CPU not counted), "
                         f"{fmt(s['decisions_per_turn'])} decisions a turn; words read {s['words_ready']}/{s['n']}; "
                         "P50 parts: "
                         + ", ".join(f"{k} {fmt(v)}" for k, v in s["breakdown_p50_ms"].items()))
        lines.append("")
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def own_server(port: int, max_sessions: int, more: list[str]) -> AsyncIterator[str]:
    """`rtc-agent serve` on a loopback port of its own, with short answers (the tiny model never stops)."""
    cli = Path(sys.executable).with_name("rtc-agent")
    proc = subprocess.Popen([str(cli), "serve", "--port", str(port), "--max-answer-s", "0.5",
                             "--max-sessions", str(max_sessions), "--ice-host-address", "127.0.0.1",
                             "--log-level", "WARNING", *more])
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(1200):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/readyz") as r:
                        if r.status == 200:
                            break
                if proc.poll() is not None:
                    raise RuntimeError("rtc-agent serve exited")
                await asyncio.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one on --port)")
    p.add_argument("--port", type=int, default=8120)
    p.add_argument("--modes", default="semantic_vad:auto,server_vad:400",
                   help="comma-separated: semantic_vad:<eagerness>, server_vad:<silence ms>")
    p.add_argument("--speech", choices=SETS + ("real",), default="heldout",
                   help="the speech set (studies/turn_speech.py): heldout is what is reported, tuning what was "
                        "tuned on; real: recordings of people (python3 -m studies.real_speech --fetch first; held out, "
                        "never tuned on)")
    p.add_argument("--sets", help="questions, paused, commas (default all three, where the set has them); for "
                                  "--speech real: finished, paused, unfinished (default all three)")
    p.add_argument("--voice", choices=VOICES, default="espeak-ng", help="the synthesizer that says a synthetic set")
    p.add_argument("--callers", type=int, default=1, help="calls at once (each speaks the whole set)")
    p.add_argument("--json", help="write every row and the summaries here")
    p.add_argument("--serve-args", default="", help="more arguments of the server it starts (\"--transcription off\": "
                   "no recogniser, Smart Turn alone)")
    args = p.parse_args()
    use_host_addresses(("127.0.0.1",))
    if args.speech == "real":
        from real_speech import KINDS as REAL_KINDS, real_set
        sentences = real_set((args.sets or ",".join(REAL_KINDS)).split(","), RATE)
    else:
        sentences = speech_set(args.speech, (args.sets or "questions,paused,commas").split(","), RATE,
                               voice=args.voice)
    modes = args.modes.split(",")
    load = os.getloadavg()
    async with (contextlib.nullcontext(args.url) if args.url else own_server(args.port, max(4, args.callers),
                                                                          args.serve_args.split())) as url:
        results = await measure(url, modes, sentences, args.callers)
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
          + " ".join(f"{v:.2f}" for v in os.getloadavg()) + f"; {os.cpu_count()} cores; callers {args.callers}\n")
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"load_before": load, "load_after": os.getloadavg(),
                                               "callers": args.callers, "results": results,
                                               "summary": {m: summary(r) for m, r in results.items()}}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
