"""`rtc-agent serve` as processes by role (server/processes.py: an engine process, two media processes and the
front), a real process tree in a private network namespace, with real aiortc callers and the official `openai`
client: calls through the front land on different media processes; SIGKILL to one media process ends only its own
calls' connections (the other caller's answer goes on to its end, every frame sent), its caller resumes in a live
process with an `error` that says so (so does a caller of `rtc-agent loadtest`, on its own), and a new media
process takes its place; a Realtime WebSocket whose process dies gets an `error`; the engine process dying is a 503
for everyone and /readyz says why, while the front stays up."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rtc_agent.client.peer import Call, CallError

from netns_support import needs_namespaces, private_network, start, stop
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import SENTENCE, audio_offer, caller, metrics_text, needs_espeak, run, say
from test_realtime_openai import Recorder, clients, speak

PORT = 8080
URL = f"http://127.0.0.1:{PORT}"
pytestmark = [needs_espeak, needs_namespaces, pytest.mark.timeout(300)]


def serve(tmp_path: Path) -> Any:
    return start([sys.executable, "-m", "rtc_agent.cli", "serve", "--port", str(PORT), "--media-processes", "2",
                  "--max-sessions", "4", "--max-answer-s", "4", "--device", "cpu", "--ice-host-address",
                  "127.0.0.1", "--turn-detection", "server_vad"], tmp_path / "serve.log")


async def get(path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(URL + path) as r:
            return r.status, await r.json()


async def until_ready(proc: Any, log: Path, media: int = 2, free: int | None = None, timeout_s: float = 150) -> dict:
    """/readyz once it is 200 with `media` media processes ready (and `free` engine slots, if given)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, body = await get("/readyz")
        except aiohttp.ClientError:
            status, body = 0, {}
        if status == 200 and body["media_processes_ready"] == media and free in (None, body["free"]):
            return body
        assert proc.poll() is None and time.monotonic() < deadline, (status, body, log.read_text()[-3000:])
        await asyncio.sleep(0.3)


def pid_of(readyz: dict, session_id: str) -> int:
    mark = session_id.removeprefix("sess_").split(".")[0]
    [pid] = [p["pid"] for p in readyz["media_processes"] if p["mark"] == mark]
    return pid


async def resume_until_taken(call: Call, mic: Any, timeout_s: float = 60) -> None:
    """Offers again with the call's resume token until a process takes it (as the page does: the front may not
    know yet that the process died, and answers 502 meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call.resume(mic)
        except CallError as exc:
            assert exc.status in (502, 503) and time.monotonic() < deadline, exc
            await asyncio.sleep(1)


def test_a_killed_media_process_ends_only_its_calls_and_is_replaced(tmp_path: Path) -> None:
    async def main() -> None:
        private_network()
        proc = serve(tmp_path)
        try:
            await until_ready(proc, tmp_path / "serve.log")
            async with caller(URL) as (gone, gone_mic), caller(URL) as (kept, kept_mic):
                marks = {c.session_id.split(".")[0] for c in (gone, kept)}
                assert marks == {"sess_m0", "sess_m1"}, marks  # the second call went to the idle process
                await say(gone, gone_mic)
                await gone.next_event("response.done", timeout_s=30)
                # mid-call, and mid-answer for the other caller: one answer at a time is what the tiny model
                # keeps in real time on CI's 2 cores with room for a new media process's start-up
                await say(kept, kept_mic)
                await kept.next_event("response.output_audio_transcript.delta", timeout_s=30)
                os.kill(pid_of((await get("/readyz"))[1], gone.session_id), signal.SIGKILL)

                done = (await kept.next_event("response.done", timeout_s=30))["response"]
                assert done["status"] == "incomplete", done
                # Every frame made was sent. Whether they came on time is the machine's capacity, a timing, and
                # timings stay out of these tests: on CI's slower 2-core machines the tiny model makes a frame in
                # 65-77 ms P50 next to the other processes, and 0-11 of this answer's 50 were late (25-45 before
                # Code2Wav's decoder worked only on the samples a frame depends on). 0 late frames with 8 callers and a
                # kill is measured on a GPU (studies/device_processes.sh).
                metrics = done["metrics"]
                print(f"\nthe kept call's answer: {metrics['frames_late']} of {metrics['frames_sent']} frames late")
                assert metrics["frames_sent"] == metrics["frames"] > 10 and metrics["frames_dropped"] == 0

                # the dead process's caller resumes: a live process takes its call over from the engine, which
                # kept its session (and slot); the caller is told with an `error`, then talks on
                old_id = gone.session_id
                await resume_until_taken(gone, gone_mic)
                error = await gone.next_event("error", timeout_s=10)
                assert error["error"]["code"] == "media_process_failed", error
                created = gone.events_of("session.created")[-1]["session"]
                assert created["id"] == gone.session_id != old_id
                assert gone.resume_token == created["resume"]["token"]
                await say(gone, gone_mic)
                again = (await gone.next_event("response.done", timeout_s=30))["response"]
                assert again["status"] == "incomplete", again
                # a new media process took the dead one's place; the moved call holds its one slot
                body = await until_ready(proc, tmp_path / "serve.log", free=2)
                assert {p["ready"] for p in body["media_processes"]} == {True}

                async with caller(URL) as (new, new_mic):
                    await say(new, new_mic)
                    again = (await new.next_event("response.done", timeout_s=30))["response"]
                    assert again["status"] == "incomplete"
            text = await metrics_text(URL)
            for process in ("front", "engine", "m0", "m1"):  # one scrape shows every process
                assert f'process_cpu_seconds_total{{process="{process}"}}' in text, process
                # start-up's objects (torch, transformers) out of the collector's reach, the front's too
                frozen = re.search(rf'^rtc_agent_gc_frozen_objects{{process="{process}"}} (\S+)$', text, re.M)
                assert frozen and float(frozen.group(1)) > 100_000, (process, frozen)
            assert 'rtc_agent_sessions_total{process="m' in text
        finally:
            stop(proc, signal.SIGINT)
        await asyncio.sleep(1.0)  # (multiprocessing's resource tracker, which outlives the front, writes last)
        log = (tmp_path / "serve.log").read_text()
        assert "exited (-9): its calls ended; starting another" in log
        assert proc.returncode == 0, log[-3000:]
        assert "leaked semaphore" not in log, log[-3000:]  # every process ended as a return does

    run(main(), timeout_s=280)


def test_a_websocket_gets_an_error_when_its_process_dies_and_the_engine_dying_is_a_503(tmp_path: Path) -> None:
    async def main() -> None:
        private_network()
        proc = serve(tmp_path)
        try:
            await until_ready(proc, tmp_path / "serve.log")
            async with clients(URL, "any-key").realtime.connect(model="tiny") as conn:
                rec = Recorder(conn)
                created = await rec.until("session.created")
                await speak(conn, "What is the weather like in Paris today?")
                done = await rec.until("response.done")
                assert done.response.status == "incomplete"
                os.kill(pid_of((await get("/readyz"))[1], created.session.id), signal.SIGKILL)
                error = await rec.until("error", timeout_s=20)
                assert error.error.code == "session_failed"

            body = await until_ready(proc, tmp_path / "serve.log")
            os.kill(body["engine_pid"], signal.SIGKILL)
            deadline = time.monotonic() + 20
            while (status := await get("/readyz"))[0] == 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            assert status[0] == 503 and status[1]["status"] == "failed" and "engine" in status[1]["error"]
            async with aiohttp.ClientSession() as http:
                async with http.post(URL + "/api/offer", json={"sdp": await audio_offer(), "type": "offer"}) as r:
                    assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unavailable"
            assert (await get("/healthz"))[0] == 200 and proc.poll() is None
        finally:
            stop(proc, signal.SIGINT)
        assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]

    run(main(), timeout_s=280)


def test_a_load_test_caller_whose_media_process_dies_resumes_in_another(tmp_path: Path) -> None:
    """`rtc-agent loadtest` (a subprocess, two callers, two turns each): SIGKILL to a media process with a call in
    its first turn; that caller notices the dead connection, resumes in a live process (the `error` it gets
    recorded), says the lost turn again and gets every answer."""
    async def main() -> None:
        private_network()
        proc = serve(tmp_path)
        try:
            await until_ready(proc, tmp_path / "serve.log")
            wav = tmp_path / "speech.wav"
            subprocess.run(["espeak-ng", "-w", str(wav), SENTENCE], check=True, capture_output=True)
            tester = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rtc_agent.cli", "loadtest", URL, "--ice-host-address", "127.0.0.1",
                "--callers", "2", "--turns", "2", "--wav", str(wav), "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            deadline = time.monotonic() + 60
            while (await get("/readyz"))[1].get("active", 0) < 2:
                assert time.monotonic() < deadline and tester.returncode is None
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)
            victim = next(p for p in (await get("/readyz"))[1]["media_processes"] if p["calls"])
            os.kill(victim["pid"], signal.SIGKILL)
            out, err = await asyncio.wait_for(tester.communicate(), 150)
            assert tester.returncode == 0, err.decode()[-3000:]
            report = json.loads(out)
            assert report["overall"]["failures"] == {} and report["overall"]["resumed"] == 1, report["overall"]
            [moved] = [c for c in report["callers"] if c["resumes"]]
            assert moved["resumes"][0]["errors"] == ["media_process_failed"], moved["resumes"]
            assert moved["summary"]["answered"] == moved["summary"]["turns"] == 2, moved["summary"]
        finally:
            stop(proc, signal.SIGINT)

    run(main(), timeout_s=280)
