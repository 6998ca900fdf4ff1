"""Soak: 200 short calls in a row against a server process (tiny model, loopback). Ended calls must be freed as
they end: after the first 20 calls the server's RSS grows by at most 20 MB, and its thread count comes back to
where it was (a call left to the cyclic GC keeps the 2 libav threads of its audio resampler until then). Every
20th call speaks and waits for its answer, so the decoders, the VAD and the engine run."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from rtc_agent.client.microphone import Microphone
from rtc_agent.client.peer import Call
from rtc_agent.media.ice import use_host_addresses
from rtc_support import LOOPBACK, needs_espeak, run, say, wait_ready
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(600)]
CALLS = 200
WARM_UP = 20
MAX_GROWTH_MB = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb_and_threads(pid: int) -> tuple[float, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


async def short_call(url: str, speak: bool) -> None:
    mic, call = Microphone(), Call(url)
    try:
        await call.connect(mic)
        await call.next_event("session.created", timeout_s=10)
        if speak:
            await say(call, mic, "Hello there.")
            done = (await call.next_event("response.done", timeout_s=30))["response"]
            assert done["status"] == "incomplete"
    finally:
        await call.hang_up()


async def settled(pid: int, threads_at_most: int | None = None) -> tuple[float, int]:
    """The server's RSS and threads once the last call is gone (its threads may take a moment to end)."""
    await asyncio.sleep(1.0)
    for _ in range(100):
        rss, threads = rss_mb_and_threads(pid)
        if threads_at_most is None or threads <= threads_at_most:
            break
        await asyncio.sleep(0.1)
    return rss, threads


def test_200_calls_in_a_row_leave_rss_and_threads_flat(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "rtc_agent.cli", "serve", "--port", str(port), "--model", "tiny", "--device", "cpu",
         "--ice-host-address", LOOPBACK[0], "--max-answer-s", "1", "--log-level", "WARNING",
         # server_vad: the end-of-turn model's shared pools (2 scoring threads, asyncio's executor) start their
         # threads lazily, after the warm-up calls (16 -> 20 threads seen with semantic_vad; not yet checked that
         # they stay bounded over more calls)
         "--turn-detection", "server_vad"],
        stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def main() -> dict[str, float]:
        use_host_addresses(LOOPBACK)
        for _ in range(600):  # the process starts listening after its imports
            try:
                await wait_ready(url, timeout_s=120)
                break
            except aiohttp.ClientConnectionError:
                assert server.poll() is None, "the server exited"
                await asyncio.sleep(0.1)
        started = time.monotonic()
        for i in range(CALLS):
            if i == WARM_UP:
                base_rss, base_threads = await settled(server.pid)
            await short_call(url, speak=i % 20 == 0)
        end_rss, end_threads = await settled(server.pid, threads_at_most=base_threads)
        return {"base_rss_mb": base_rss, "end_rss_mb": end_rss, "base_threads": base_threads,
                "end_threads": end_threads, "seconds": time.monotonic() - started}

    try:
        numbers = run(main(), timeout_s=540)
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    growth = numbers["end_rss_mb"] - numbers["base_rss_mb"]
    print(f"soak: {CALLS} calls in {numbers['seconds']:.0f} s; RSS {numbers['base_rss_mb']:.1f} MB after "
          f"{WARM_UP} calls -> {numbers['end_rss_mb']:.1f} MB (+{growth:.1f}); threads "
          f"{numbers['base_threads']} -> {numbers['end_threads']}")
    assert growth <= MAX_GROWTH_MB, numbers
    assert numbers["end_threads"] <= numbers["base_threads"], numbers
    assert "Traceback" not in (tmp_path / "server.log").read_text()
