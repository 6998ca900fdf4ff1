"""`rtc-agent loadtest URL --callers N`: N independent aiortc callers, at once or ramped, each speaking the WAV's
utterances as a person would (one, then wait for the answer to end, a pause, the next) and listening to the
answers. Per caller and overall: the latency each caller hears, the server's own numbers from response.done
(ttfp_ms, frames late and dropped), gaps in the answer audio as it arrived, and failures.

The callers are spread over `--processes` client processes (by default one per four callers, at most half the
cores), each with its own event loop: a Python process receiving and decoding many calls' audio is late to see
their packets arrive, and that lateness would be counted against the server."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import queue
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import aiohttp
import numpy as np

from ..loop_lag import LoopLag
from ..media.ice import use_host_addresses
from . import server_processes
from .call import ANSWER_PACKET, CONNECT_WARMUP_S, GAP_S, TAIL_S, connection_gone, dial, load_speech, turn_report
from .microphone import RATE, Microphone
from .peer import Call, CallError, ReceivedAudio

DEFAULT_SENTENCE = "What is the weather like in Paris today?"
PAUSE_S = 1.0  # after an answer ends, before the caller speaks again
READY_POLL_S = 0.5
MEDIA_START_S = 10.0  # from connected to the microphone's first packet
PROCESS_START_S = 60.0  # for every client process to be ready (imports), before the callers start together
CALLERS_PER_PROCESS = 4
LOST_S = 4.0  # no packet from the server for this long: the connection is lost (the page decides the same way)
RESUME_RETRY_S = 1.0  # between two resume offers
log = logging.getLogger(__name__)


def default_processes(callers: int) -> int:
    """Client processes for `callers`: one per `CALLERS_PER_PROCESS`, at most half this machine's cores."""
    return max(1, min(math.ceil(callers / CALLERS_PER_PROCESS), (os.cpu_count() or 2) // 2))


@dataclasses.dataclass(frozen=True)
class LoadSettings:
    callers: int = 1
    ramp_s: float = 0.0  # caller k starts at k * ramp_s / callers
    turns: int = 1  # times each caller says the whole WAV
    max_wait_s: float = 30.0  # an answer that has not ended this long after the speech and after its latest
    # packet (not streaming) counts as a failure: a long answer that streams on is waited for
    retry_s: float = 0.0  # retry a 503 (server_full, not_ready) this long, after its Retry-After; 0: fail
    gap_s: float = GAP_S
    processes: int = 1  # client processes the callers are spread over, each with its own event loop

    def __post_init__(self) -> None:
        if not 1 <= self.callers <= 256:
            raise ValueError("--callers must be between 1 and 256")
        if not 1 <= self.processes <= self.callers:
            raise ValueError("--processes must be between 1 and --callers")
        if self.ramp_s < 0 or self.retry_s < 0:
            raise ValueError("--ramp-s and --retry-s must not be negative")
        if not 1 <= self.turns <= 100:
            raise ValueError("--turns must be between 1 and 100")
        if self.max_wait_s <= 0 or self.gap_s <= 0:
            raise ValueError("--max-wait-s and --gap-ms must be positive")


def speech_wav(wav: str | None, folder: str) -> str:
    """The WAV to speak: `wav`, or one espeak-ng makes in `folder` when none is given."""
    if wav:
        return wav
    if shutil.which("espeak-ng") is None:
        raise ValueError("give --wav FILE (utterances separated by >= 1 s pauses), or install espeak-ng to make one")
    path = str(Path(folder) / "speech.wav")
    subprocess.run(["espeak-ng", "-w", path, DEFAULT_SENTENCE], check=True, capture_output=True)
    return path


async def run_loadtest(url: str, wav: str | None, settings: LoadSettings, *, token: str | None = None,
                       voice: str | None = None, instructions: str | None = None, verify_tls: bool = True,
                       ice_servers: tuple[str, ...] = (), ice_host_addresses: tuple[str, ...] = (),
                       captions: bool = True) -> dict[str, Any]:
    use_host_addresses(ice_host_addresses)
    with tempfile.TemporaryDirectory() as tmp:
        wav = speech_wav(wav, tmp)
        samples, spans = load_speech(wav)
    call_kwargs = dict(token=token, voice=voice, instructions=instructions, ice_servers=ice_servers,
                       verify_tls=verify_tls, captions=captions)
    if settings.retry_s:
        await wait_ready(url, settings.retry_s, verify_tls)
    groups = [list(range(p, settings.callers, settings.processes)) for p in range(settings.processes)]
    work = (url, samples, spans, settings, call_kwargs)
    before, started = await server_processes.snapshot(url, verify_tls), time.monotonic()
    if len(groups) == 1:
        callers, lag_ms = await _run_callers(groups[0], *work)
    else:
        parts = await asyncio.get_running_loop().run_in_executor(None, _in_processes, groups, work,
                                                                 ice_host_addresses)
        callers = sorted((c for part, _ in parts for c in part), key=lambda c: c["caller"])
        lag_ms = max(lag for _, lag in parts)
    spent = server_processes.usage(before, await server_processes.snapshot(url, verify_tls),
                                   time.monotonic() - started)
    return {"url": url.rstrip("/"), "wav": wav, "utterances": len(spans), "settings": dataclasses.asdict(settings),
            "overall": summary(callers, lag_ms), "server_processes": spent, "callers": callers}


async def _run_callers(indices: list[int], url: str, samples: np.ndarray, spans: list[tuple[int, int]],
                       settings: LoadSettings, call_kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """The callers `indices` on this event loop; returns their results and how late the loop woke up at most."""
    lag = LoopLag()
    watcher = asyncio.ensure_future(lag.watch())
    try:
        callers = await asyncio.gather(*(
            _caller(i, i * settings.ramp_s / settings.callers, url, samples, spans, settings, call_kwargs)
            for i in indices))
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return list(callers), lag.max_ms


class ClientProcessError(RuntimeError):
    """A load-test client process died or failed outside its callers (their own failures are in the report)."""


def _in_processes(groups: list[list[int]], work: tuple, ice_host_addresses: tuple[str, ...]
                  ) -> list[tuple[list[dict[str, Any]], float]]:
    """Each group of callers in a process of its own (blocking). The processes start their callers together once
    all of them are ready; each sends back `_run_callers`' result, or why it failed."""
    context = multiprocessing.get_context("spawn")  # (a fork would copy this process's event loop and threads)
    ready, results = context.Barrier(len(groups)), context.Queue()
    processes = [context.Process(target=_process_main, daemon=True, name=f"loadtest-{n}",
                                 args=(group, work, ice_host_addresses, logging.getLogger().level, ready, results))
                 for n, group in enumerate(groups)]
    for process in processes:
        process.start()
    parts = []
    try:
        while len(parts) < len(processes):
            try:
                part = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise ClientProcessError("a load-test client process died") from None
                continue
            if isinstance(part, str):
                raise ClientProcessError(f"a load-test client process failed: {part}")
            parts.append(part)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
    return parts


def _process_main(indices: list[int], work: tuple, ice_host_addresses: tuple[str, ...], log_level: int,
                  ready, results) -> None:
    """A client process: its callers' results (or the error, as text) go into `results`."""
    logging.basicConfig(level=log_level)
    try:
        use_host_addresses(ice_host_addresses)
        ready.wait(PROCESS_START_S)
        results.put(asyncio.run(_run_callers(indices, *work)))
    except BaseException as exc:  # noqa: BLE001  (reported by the parent, which would otherwise wait on)
        results.put(f"{type(exc).__name__}: {exc}")


async def wait_ready(url: str, timeout_s: float, verify_tls: bool = True) -> None:
    """Until GET /readyz says 200 (the model is loaded), so that the callers start together; at most `timeout_s`
    (then the callers try anyway, and a server still loading refuses them with not_ready)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(f"{url.rstrip('/')}/readyz", ssl=verify_tls) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass  # not listening yet
            await asyncio.sleep(READY_POLL_S)


async def _caller(index: int, delay_s: float, url: str, samples: np.ndarray, spans: list[tuple[int, int]],
                  settings: LoadSettings, call_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One caller from dialling to hanging up. Its failures end up in its result, never in another caller's."""
    await asyncio.sleep(delay_s)
    result: dict[str, Any] = {"caller": index, "pid": os.getpid(), "session_id": None, "started_s": round(delay_s, 3),
                              "connected_ms": None, "attempts": None, "turns": [], "resumes": [], "failure": None}
    call: Call | None = None
    try:
        started = time.monotonic()
        call, mic, result["attempts"] = await dial(url, retry_s=settings.retry_s, **call_kwargs)
        result["session_id"] = call.session_id
        result["connected_ms"] = round((time.monotonic() - started) * 1000, 1)
        result["failure"] = await _converse(call, mic, samples, spans, settings, result["turns"], result["resumes"])
    except CallError as exc:
        result["failure"] = {"code": exc.code, "status": exc.status, "message": exc.message,
                             "retry_after_s": exc.retry_after_s, "reason": exc.reason}
    except asyncio.TimeoutError:
        result["failure"] = {"code": "connect_timeout", "message": "the call's data channel never opened (ICE/DTLS)"}
    except (OSError, aiohttp.ClientError) as exc:
        result["failure"] = {"code": "connect_error", "message": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # a fault in this client: reported for this caller, the others go on
        log.exception("caller %d", index)
        result["failure"] = {"code": "client_error", "message": f"{type(exc).__name__}: {exc}"}
    finally:
        if call is not None:
            await call.hang_up()
    return result


async def _converse(call: Call, mic: Microphone, samples: np.ndarray, spans: list[tuple[int, int]],
                    settings: LoadSettings, turns: list[dict[str, Any]], resumes: list[dict[str, Any]]
                    ) -> dict[str, Any] | None:
    """Says each utterance `settings.turns` times, each after the answer to the one before has ended; fills
    `turns`. A connection lost mid-turn is resumed (`resumes`), as the page does, and that turn said again.
    Returns the failure that stopped the caller (None: every turn got an answer)."""
    await _until(lambda: mic.started_at is not None or connection_gone(call), MEDIA_START_S)
    if mic.started_at is None:
        return {"code": "no_media", "message": f"no audio went out within {MEDIA_START_S:g} s of connecting"}
    failure = None
    said: list[tuple[float, float]] = []  # (speech start, speech end) of each utterance, time.monotonic()
    mic.play(np.zeros(int(CONNECT_WARMUP_S * RATE), np.float32))
    turn = 0
    while turn < settings.turns * len(spans):
        start, end = spans[turn % len(spans)]
        at = mic.play(samples[start:end])
        said.append((mic.time_at(at), mic.time_at(at + end - start)))
        speech_start, speech_end = said[-1]
        await _until(lambda: answer_done(call, speech_start)[0] is not None or connection_lost(call)
                     or time.monotonic() - latest_answer_packet(call.audio, speech_end) > settings.max_wait_s,
                     math.inf)  # (the answer has ended, or it has not and none streamed for max_wait_s)
        answered = answer_done(call, speech_start)[0] is not None
        if not answered and connection_lost(call):
            if not await _resume(call, mic, turn, resumes):
                failure = {"code": "connection_lost", "message": f"the connection was lost during turn {turn + 1} "
                                                                 "and could not be resumed"}
                break
            said.pop()  # lost with the connection: said again on the new one
            continue
        if not answered:
            failure = {"code": "no_answer", "message": f"turn {turn + 1}: no answer ended, and none streamed for "
                                                      f"{settings.max_wait_s:g} s after the speech"}
            break
        turn += 1
        if turn < settings.turns * len(spans):
            await asyncio.sleep(PAUSE_S)
    await asyncio.sleep(TAIL_S)
    for i, (start_at, end_at) in enumerate(said):
        next_at = said[i + 1][0] if i + 1 < len(said) else float("inf")
        done, cut_ins = answer_done(call, start_at, next_at)
        turns.append({**turn_report(call, end_at, next_at, done, settings.gap_s, start_at=start_at),
                      "cut_ins": cut_ins, "speech_end_monotonic_s": round(end_at, 4)})
    return failure


def answer_done(call: Call, since: float, until: float = math.inf) -> tuple[dict[str, Any] | None, int]:
    """The `response` of the answer to an utterance that began at `since` (time.monotonic()): the first
    response.done after it, before `until`, that the caller's own speech did not cancel; and how many answers it
    did cancel before that one (cut-ins: the server took a pause inside the utterance for its end, answered over
    the caller, and the caller's next words stopped it). A load-test caller never talks over an answer on
    purpose: it waits for each to end."""
    cut_ins = 0
    for at, message in call.events:
        if message["type"] != "response.done" or not since < at < until:
            continue
        if message["response"]["status"] != "cancelled":
            return message["response"], cut_ins
        cut_ins += 1
    return None, cut_ins


def connection_lost(call: Call) -> bool:
    """The connection failed or closed, or nothing came from the server for `LOST_S` (it sends silence between
    answers, so a quiet connection is a dead one)."""
    return connection_gone(call) or bool(call.audio.times and time.monotonic() - call.audio.times[-1] > LOST_S)


async def _resume(call: Call, mic: Microphone, turn: int, resumes: list[dict[str, Any]]) -> bool:
    """Offers again with the call's resume token until a server process takes the call, within the resume window
    that `session.created` gave; records it in `resumes` (with the `error` the server sent after, if any)."""
    created = call.events_of("session.created")
    window_s = float(created[-1]["session"].get("resume", {}).get("window_s", 0)) if created else 0.0
    if not call.resume_token or window_s <= 0:
        return False
    lost_at, session_id, errors = time.monotonic(), call.session_id, len(call.events_of("error"))
    attempts = 0
    while time.monotonic() - lost_at < window_s - RESUME_RETRY_S:
        attempts += 1
        try:
            await call.resume(mic)
        except (CallError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if isinstance(exc, CallError) and exc.status < 500:  # 404: the server no longer has the call
                return False
            await asyncio.sleep(RESUME_RETRY_S)
            continue
        await asyncio.sleep(0.5)  # (what the server says right after session.created)
        resumes.append({"turn": turn + 1, "ms": round((time.monotonic() - lost_at) * 1000, 1), "attempts": attempts,
                        "from": session_id, "to": call.session_id,
                        "errors": [m["error"]["code"] for m in call.events_of("error")[errors:]]})
        return True
    return False


def latest_answer_packet(audio: ReceivedAudio, since: float) -> float:
    """Arrival time of the latest answer packet (80 ms) after `since`, or `since` when none came after it."""
    for at, size in zip(reversed(audio.times), reversed(audio.decoded)):
        if at <= since:
            break
        if size == ANSWER_PACKET:
            return at
    return since


async def _until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> None:
    """Returns once `condition()` holds or `timeout_s` has passed."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    p50, p90 = np.percentile(values, [50, 90])
    return {"n": len(values), "p50": round(float(p50), 1), "p90": round(float(p90), 1),
            "max": round(float(max(values)), 1)}


def _server(turn: dict[str, Any], *keys: str) -> Any:
    value: Any = turn["server"] or {}
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def caller_summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Latencies, frame counts and gaps over some turns (one caller's, or every caller's)."""
    def values(*keys: str) -> list[float]:
        return [v for t in turns if (v := _server(t, *keys)) is not None]

    threads = [n for t in turns for n in _server(t, "end_of_turn", "decision_threads") or []]

    return {
        "turns": len(turns),
        "answered": sum(1 for t in turns if t["server"] is not None),
        "cut_ins": sum(t.get("cut_ins", 0) for t in turns),
        "heard_ms": percentiles([t["client_latency_ms"] for t in turns if t["client_latency_ms"] is not None]),
        "server_ttfp_ms": percentiles(values("ttfp_ms")),
        "engine_ttfp_ms": percentiles(values("engine", "ttfp_ms")),
        # semantic_vad: silence before the turn ended, and how long its deciding verdict took to come back
        "end_of_turn_wait_ms": percentiles(values("end_of_turn", "wait_ms")),
        "verdict_ms": percentiles(values("end_of_turn", "verdict_ms")),
        "decisions": len(threads),
        "decisions_on_engine": threads.count(0),  # (0 threads: the engine's GPU, --end-of-turn-on)
        "engine_frame_ms_p90": percentiles(values("engine", "frame_ms_p90")),  # each turn's P90, across turns
        "interval_ms_p90": percentiles([t["interval_ms_p90"] for t in turns if t["interval_ms_p90"] is not None]),
        "frames_sent": int(sum(values("frames_sent"))),
        "frames_late": int(sum(values("frames_late"))),
        "frames_dropped": int(sum(values("frames_dropped"))),
        "gaps": sum(t["gaps"] for t in turns),
        "max_gap_ms": max((t["max_gap_ms"] for t in turns if t["max_gap_ms"] is not None), default=None),
        "server_loop_lag_ms_max": max(values("loop_lag_ms_max"), default=None),
        # the caller's words: turns with a caption, its delay after the speech's end, and the deltas before it
        "captioned": sum(1 for t in turns if t.get("caption") is not None),
        "caption_ms": percentiles([t["caption_ms"] for t in turns if t.get("caption_ms") is not None]),
        "caption_deltas_before_end": sum(t.get("caption_deltas_before_end", 0) for t in turns),
    }


def summary(callers: list[dict[str, Any]], loop_lag_ms: float) -> dict[str, Any]:
    for c in callers:
        c["summary"] = caller_summary(c["turns"])
    failures: dict[str, int] = {}
    for c in callers:
        if c["failure"]:
            failures[c["failure"]["code"]] = failures.get(c["failure"]["code"], 0) + 1
    return {"callers": len(callers), "connected": sum(1 for c in callers if c["session_id"]),
            "failed": sum(1 for c in callers if c["failure"]), "failures": failures,
            "resumed": sum(1 for c in callers if c.get("resumes")),
            **caller_summary([t for c in callers for t in c["turns"]]),
            "speech_end_spread_ms": speech_end_spread(callers),
            "client_loop_lag_ms_max": round(loop_lag_ms, 1)}


def speech_end_spread(callers: list[dict[str, Any]]) -> list[float]:
    """For each turn (the callers' first, second...), how far apart the callers' speech ended: the last less the
    first, in ms. Callers started together do not stop together (each call's media starts when it connects), and
    at many callers this spread decides much of the heard latency: the server's work for the turns that ended
    first is done, or not, by the time the last ones end (24 at once on an H200: spreads of 23-99 ms, and heard
    follows them; docs/performance.md, "Many callers at once")."""
    ends: dict[int, list[float]] = {}
    for c in callers:
        for n, turn in enumerate(c["turns"]):
            ends.setdefault(n, []).append(turn["speech_end_monotonic_s"])
    return [round((max(at) - min(at)) * 1000, 1) for _, at in sorted(ends.items())]


def _pp(p: dict[str, Any]) -> str:
    return "-" if p["p50"] is None else f"{p['p50']:.0f}/{p['p90']:.0f}"


def _failure(f: dict[str, Any]) -> str:
    """A caller's failure in one line: code (reason): message (Retry-After)."""
    reason = f" ({f['reason']})" if f.get("reason") else ""
    retry = f" (Retry-After {f['retry_after_s']:g} s)" if f.get("retry_after_s") is not None else ""
    return f"{f['code']}{reason}: {f['message']}{retry}"


def print_loadtest(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    s = report["settings"]
    print(f"{s['callers']} callers on {report['url']} (ramp {s['ramp_s']:g} s, {s['processes']} client "
          f"process{'es' if s['processes'] > 1 else ''}), each saying {report['utterances']} utterance(s) x "
          f"{s['turns']}; latencies are P50/P90 in ms")
    print(f"{'caller':>6} {'session':<18} {'connect':>16} {'answered':>9} {'heard':>11} {'server ttfp':>12} "
          f"{'late':>5} {'dropped':>8} {'gaps':>5}  failure")
    for c in report["callers"]:
        m, f = c["summary"], c["failure"]
        connect = "-" if c["connected_ms"] is None else f"{c['connected_ms']:.0f} ms"
        if (c["attempts"] or 1) > 1:
            connect += f" ({c['attempts']} tries)"
        why = "" if not f else _failure(f)
        print(f"{c['caller']:>6} {c['session_id'] or '-':<18} {connect:>16} {m['answered']:>4}/{m['turns']:<4} "
              f"{_pp(m['heard_ms']):>11} {_pp(m['server_ttfp_ms']):>12} {m['frames_late']:>5} "
              f"{m['frames_dropped']:>8} {m['gaps']:>5}  {why}")
    o = report["overall"]
    h, t, e = o["heard_ms"], o["server_ttfp_ms"], o["engine_ttfp_ms"]
    why = ", ".join(f"{n} {code}" for code, n in o["failures"].items())
    resumed = f", {o['resumed']} resumed a lost connection" if o.get("resumed") else ""
    print(f"overall: {o['connected']}/{o['callers']} connected, {o['failed']} failed{f' ({why})' if why else ''}"
          f"{resumed}; {o['answered']}/{o['turns']} turns answered"
          + (f"; {o['cut_ins']} answers began inside a caller's utterance and were cut by it" if o["cut_ins"] else ""))
    print(f"  heard latency (end of speech -> first answer audio): P50 {h['p50']} ms, P90 {h['p90']} ms, "
          f"max {h['max']} ms over {h['n']} turns")
    if o["callers"] > 1 and o["speech_end_spread_ms"]:
        print(f"  the callers' speech ended within {', '.join(f'{ms:g}' for ms in o['speech_end_spread_ms'])} ms of "
              "each other (each turn: the last less the first)")
    print(f"  server ttfp_ms (turn end -> first packet): P50 {t['p50']}, P90 {t['p90']}, max {t['max']}; "
          f"engine ttfp P50 {e['p50']}, P90 {e['p90']}")
    if o["captioned"]:
        c = o["caption_ms"]
        print(f"  captions of the callers' words: {o['captioned']}/{o['turns']} turns, the last part in P50 "
              f"{c['p50']}, P90 {c['p90']} ms after the speech ended")
    w, v = o["end_of_turn_wait_ms"], o["verdict_ms"]
    if w["n"]:
        print(f"  silence waited before the turn ended: P50 {w['p50']}, P90 {w['p90']} ms"
              + (f"; the end-of-turn verdicts came back after P50 {v['p50']}, P90 {v['p90']} ms" if v["n"] else "")
              + (f"; {o['decisions_on_engine']} of {o['decisions']} decisions on the engine"
                 if o["decisions_on_engine"] else ""))
    f, i = o["engine_frame_ms_p90"], o["interval_ms_p90"]
    print(f"  each answer's P90, over answers (P50/max): engine frame time {f['p50']}/{f['max']} ms, "
          f"answer packet arrival interval {i['p50']}/{i['max']} ms (80 is real time)")
    print(f"  frames sent {o['frames_sent']}, late {o['frames_late']}, dropped {o['frames_dropped']}; "
          f"gaps > {s['gap_s'] * 1000:.0f} ms in the received answer audio: {o['gaps']} "
          f"(longest interval {o['max_gap_ms']} ms)")
    lag = o["server_loop_lag_ms_max"]
    if lag is not None:
        print(f"  the server's event loop woke up to {lag} ms late during the answered turns"
              + (" (high: the server's CPU side, media and signaling, is a bottleneck)" if lag > 50 else ""))
    for name, p in report["server_processes"].items():
        late = p[f"loop_late_over_{server_processes.LATE_MS:g}_ms"]
        print(f"  server process {name}: CPU {p['cpu_pct']} % of a core; event loop late by more than "
              f"{server_processes.LATE_MS:g} ms on {late} of {p['loop_wakeups']} wake-ups (all within "
              f"{p['loop_lag_ms_at_most']} ms); longest garbage collection within {p['gc_pause_ms_at_most']} ms")
    print(f"  the client's event loops woke up to {o['client_loop_lag_ms_max']} ms late"
          + (" (high: the load tester itself may be the bottleneck)" if o["client_loop_lag_ms_max"] > 50 else ""))
