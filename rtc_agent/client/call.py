"""`rtc-agent call URL --wav FILE`: a scripted caller. It speaks the WAV, records the answers, and reports each
turn's latency as the caller hears it (end of speech in the WAV -> first answer audio arriving) next to the
server's own numbers from response.done."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import wave
from typing import Any

import numpy as np

from ..media.ice import use_host_addresses
from .camera import SyntheticCamera
from .microphone import RATE, Microphone, load_audio, speech_spans
from .peer import RECORD_RATE, Call, CallError, ReceivedAudio, server_ice_servers

log = logging.getLogger(__name__)
CONNECT_WARMUP_S = 0.5  # silence before the WAV starts, so the first words are not lost to connection setup
TAIL_S = 0.3  # after the last answer: its last packets are still on the wire
ANSWER_PACKET = 3840  # samples (48 kHz) an answer packet decodes to: one 80 ms frame; silence packets are 960
RETRYABLE = ("server_full", "not_ready", "draining")  # 503s that say when to come back (Retry-After)
RETRY_S = 1.0  # when a 503 has no Retry-After
GAP_S = 0.12  # answer packets (one per 80 ms) further apart than this on arrival: the caller hears the audio stop


async def run_call(url: str, wav: str, *, video: bool = False, record: str | None = None, token: str | None = None,
                   voice: str | None = None, instructions: str | None = None, answer_timeout_s: float = 60.0,
                   verify_tls: bool = True, ice_servers: tuple[str, ...] = (),
                   ice_host_addresses: tuple[str, ...] = (), relay_only: bool = False, captions: bool = True
                   ) -> dict[str, Any]:
    use_host_addresses(ice_host_addresses)
    samples, spans = load_speech(wav)
    servers = ice_servers or await server_ice_servers(url, token, verify_tls)
    started = time.monotonic()
    call, mic, _ = await dial(url, video=video, token=token, voice=voice, instructions=instructions,
                              ice_servers=servers, relay_only=relay_only, verify_tls=verify_tls, captions=captions)
    try:
        connected_ms = (time.monotonic() - started) * 1000
        mic.play(np.zeros(int(CONNECT_WARMUP_S * RATE), np.float32))
        offset = mic.play(samples)
        await _wait_for_answers(call, mic, len(spans), answer_timeout_s)
        packets = await call.packets_received()
        duration = time.monotonic() - (call.audio.times[0] if call.audio.times else started)
        report = _report(call, mic, offset, spans, connected_ms)
        report["packets"] = {"received": packets, "per_second": round(packets / max(duration, 1e-3), 2),
                             **_answer_packets(call), "pts_steps": sorted({int(d) for d in np.diff(call.audio.pts)})}
        if record:
            _write_wav(record, call.audio.waveform(), RECORD_RATE)
            report["recording"] = record
        return report
    finally:
        await call.hang_up()


async def dial(url: str, *, video: bool = False, retry_s: float = 0.0, **call_kwargs: Any
               ) -> tuple[Call, Microphone, int]:
    """A connected call, its microphone, and how many offers it took. A 503 `server_full`/`not_ready` is tried
    again after its Retry-After while `retry_s` lasts (each try a fresh peer connection); other refusals,
    and the last one, raise CallError."""
    give_up_at = time.monotonic() + retry_s
    attempts = 0
    while True:
        call, mic = Call(url, **call_kwargs), Microphone()
        attempts += 1
        try:
            await call.connect(mic, SyntheticCamera() if video else None)
            return call, mic, attempts
        except CallError as exc:
            await call.close()
            wait_s = exc.retry_after_s if exc.retry_after_s is not None else RETRY_S
            if exc.code not in RETRYABLE or time.monotonic() + wait_s > give_up_at:
                if attempts == 1:
                    raise
                raise CallError(exc.status, exc.code, f"{exc.message} ({attempts} tries)", exc.retry_after_s) from exc
            await asyncio.sleep(wait_s)
        except BaseException:
            await call.close()
            raise


def load_speech(wav: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The WAV as the microphone plays it (mono, 48 kHz) and its utterances' (start, end) sample indices."""
    samples = load_audio(wav, RATE)
    spans = speech_spans(samples)
    if not spans:
        raise ValueError(f"{wav}: no speech found")
    return samples, spans


def connection_gone(call: Call) -> bool:
    return call.pc.connectionState in ("closed", "failed")


async def _wait_for_answers(call: Call, mic: Microphone, turns: int, timeout_s: float) -> None:
    """Until the WAV has played and an answer ended for each utterance (or `timeout_s` after the WAV, or the
    connection is gone)."""
    while not mic.idle and not connection_gone(call):
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + timeout_s
    while len(call.events_of("response.done")) < turns and time.monotonic() < deadline and not connection_gone(call):
        await asyncio.sleep(0.1)
    await asyncio.sleep(TAIL_S)


def _report(call: Call, mic: Microphone, offset: int, spans: list[tuple[int, int]], connected_ms: float
            ) -> dict[str, Any]:
    dones = [m["response"] for m in call.events_of("response.done")]
    turns = []
    for i, (start, end) in enumerate(spans):
        t_next = mic.time_at(offset + spans[i + 1][0]) if i + 1 < len(spans) else float("inf")
        turns.append({"speech_end_s": round(end / RATE, 3),
                      **turn_report(call, mic.time_at(offset + end), t_next, dones[i] if i < len(dones) else None,
                                    start_at=mic.time_at(offset + start))})
    return {"url": call.url, "session_id": call.session_id, "connected_ms": round(connected_ms, 1), "turns": turns,
            "events": [m["type"] for _, m in call.events]}


def turn_report(call: Call, end_at: float, next_at: float, done: dict[str, Any] | None, gap_s: float = GAP_S,
                start_at: float | None = None) -> dict[str, Any]:
    """One turn as the caller lived it: speech ended at `end_at`, the caller spoke again at `next_at` (both
    time.monotonic()); `done` is the turn's response.done (None: no answer came); `start_at`: when the speech
    began (for its caption)."""
    heard = call.audio.first_sound_after(end_at, until=next_at)
    return {
        "client_latency_ms": None if heard is None else round((heard - end_at) * 1000, 1),
        "server": done["metrics"] if done else None,
        "status": done["status"] if done else "no answer",
        "transcript": done.get("transcript", "") if done else "",
        **(caption_report(call, start_at, end_at, next_at) if start_at is not None else {}),
        **answer_gaps(call.audio, end_at, next_at, gap_s),
    }


def caption_report(call: Call, start_at: float, end_at: float, next_at: float) -> dict[str, Any]:
    """The caption of speech said in [start_at, end_at): the completed transcripts that arrived from its start
    until the next speech, in order; when the last of them came after the speech ended (caption_ms); and how many
    deltas arrived before it ended."""
    completed = [(at, m) for at, m in call.events if start_at <= at < next_at
                 and m["type"] == "conversation.item.input_audio_transcription.completed"]
    deltas = sum(1 for at, m in call.events if start_at <= at < end_at
                 and m["type"] == "conversation.item.input_audio_transcription.delta")
    text = " ".join(m["transcript"] for _, m in completed if m["transcript"])
    return {"caption": text if completed else None,
            "caption_ms": round((completed[-1][0] - end_at) * 1000, 1) if completed else None,
            "caption_deltas_before_end": deltas}


def answer_gaps(audio: ReceivedAudio, since: float, until: float, gap_s: float = GAP_S) -> dict[str, Any]:
    """How steadily the answer audio that arrived in [since, until) came: answer packets (80 ms, RTP step 3840)
    should arrive every 80 ms; a gap is two consecutive ones more than `gap_s` apart (a stall the caller hears);
    interval_ms_p90 is the P90 of their arrival intervals.
    A frame the server had not made in time still goes out on time as 80 ms of zeros: the server counts those
    (`frames_late` in response.done), not this."""
    arrivals = [at for at, size in zip(audio.times, audio.decoded) if since <= at < until and size == ANSWER_PACKET]
    intervals = np.diff(arrivals) if len(arrivals) > 1 else np.zeros(0)
    ms = intervals * 1000
    return {"answer_packets": len(arrivals), "gaps": int(np.sum(intervals > gap_s)),
            "interval_ms_p90": round(float(np.percentile(ms, 90)), 1) if len(ms) else None,
            "max_gap_ms": round(float(ms.max()), 1) if len(ms) else None}


def _answer_packets(call: Call, min_run: int = 5) -> dict[str, Any]:
    """Packets of answer audio (80 ms ones) and their rate within each answer."""
    runs: list[list[float]] = []
    previous = 0
    for at, size in zip(call.audio.times, call.audio.decoded):
        if size == ANSWER_PACKET:
            if previous != ANSWER_PACKET:
                runs.append([])
            runs[-1].append(at)
        previous = size
    runs = [r for r in runs if len(r) >= min_run]
    span = sum(r[-1] - r[0] for r in runs)
    rate = sum(len(r) - 1 for r in runs) / span if span else None
    return {"answer_packets": sum(len(r) for r in runs), "answer_per_second": rate and round(rate, 2)}


def _write_wav(path: str, samples: np.ndarray, rate: int) -> None:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"session {report['session_id']}: connected in {report['connected_ms']:.0f} ms")
    for i, t in enumerate(report["turns"], 1):
        s = t["server"] or {}
        print(f"turn {i}: {t['status']}; heard after {t['client_latency_ms']} ms "
              f"(server first packet {s.get('ttfp_ms')} ms after turn end, {s.get('frames_sent')} frames, "
              f"{s.get('audio_s')} s; {t['gaps']} gaps in the audio, longest {t['max_gap_ms']} ms)")
        if t.get("caption") is not None:
            print(f"  caller: {t['caption']} (caption {t['caption_ms']} ms after the speech, "
                  f"{t['caption_deltas_before_end']} deltas before its end)")
        if t["transcript"]:
            print(f"  agent: {t['transcript']}")
    p = report["packets"]
    print(f"audio packets received: {p['received']} ({p['per_second']}/s); answer packets: {p['answer_packets']} "
          f"({p['answer_per_second']}/s while speaking); RTP timestamp steps {p['pts_steps']}")
