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
from .peer import RECORD_RATE, Call, server_ice_servers

log = logging.getLogger(__name__)
CONNECT_WARMUP_S = 0.5  # silence before the WAV starts, so the first words are not lost to connection setup


async def run_call(url: str, wav: str, *, video: bool = False, record: str | None = None, token: str | None = None,
                   voice: str | None = None, instructions: str | None = None, answer_timeout_s: float = 60.0,
                   verify_tls: bool = True, ice_servers: tuple[str, ...] = (),
                   ice_host_addresses: tuple[str, ...] = (), relay_only: bool = False) -> dict[str, Any]:
    use_host_addresses(ice_host_addresses)
    samples = load_audio(wav, RATE)
    spans = speech_spans(samples)
    if not spans:
        raise ValueError(f"{wav}: no speech found")
    mic = Microphone()
    servers = ice_servers or await server_ice_servers(url, token, verify_tls)
    call = Call(url, token=token, voice=voice, instructions=instructions, ice_servers=servers,
                relay_only=relay_only, verify_tls=verify_tls)
    started = time.monotonic()
    try:
        await call.connect(mic, SyntheticCamera() if video else None)
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


async def _wait_for_answers(call: Call, mic: Microphone, turns: int, timeout_s: float) -> None:
    """Until the WAV has played and an answer ended for each utterance (or `timeout_s` after the WAV, or the
    connection is gone)."""
    def gone() -> bool:
        return call.pc.connectionState in ("closed", "failed")

    while not mic.idle and not gone():
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + timeout_s
    while len(call.events_of("response.done")) < turns and time.monotonic() < deadline and not gone():
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)  # the last packets are still on the wire


def _report(call: Call, mic: Microphone, offset: int, spans: list[tuple[int, int]], connected_ms: float
            ) -> dict[str, Any]:
    dones = [m["response"] for m in call.events_of("response.done")]
    turns = []
    for i, (start, end) in enumerate(spans):
        t_end = mic.time_at(offset + end)
        t_next = mic.time_at(offset + spans[i + 1][0]) if i + 1 < len(spans) else float("inf")
        heard = call.audio.first_sound_after(t_end, until=t_next)
        server = dones[i] if i < len(dones) else None
        turns.append({
            "speech_end_s": round(end / RATE, 3),
            "client_latency_ms": None if heard is None else round((heard - t_end) * 1000, 1),
            "server": server["metrics"] if server else None,
            "status": server["status"] if server else "no answer",
            "transcript": server.get("transcript", "") if server else "",
        })
    return {"url": call.url, "session_id": call.session_id, "connected_ms": round(connected_ms, 1), "turns": turns,
            "events": [m["type"] for _, m in call.events]}


def _answer_packets(call: Call, min_run: int = 5) -> dict[str, Any]:
    """Packets of answer audio (80 ms ones) and their rate within each answer."""
    runs: list[list[float]] = []
    previous = 0
    for at, size in zip(call.audio.times, call.audio.decoded):
        if size == 3840:
            if previous != 3840:
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
              f"{s.get('audio_s')} s)")
        if t["transcript"]:
            print(f"  agent: {t['transcript']}")
    p = report["packets"]
    print(f"audio packets received: {p['received']} ({p['per_second']}/s); answer packets: {p['answer_packets']} "
          f"({p['answer_per_second']}/s while speaking); RTP timestamp steps {p['pts_steps']}")
