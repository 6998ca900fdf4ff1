"""/capacity and the SIGTERM drain of a real `rtc-agent serve` process (in a private network namespace): a full
server says so, a draining one takes no new call but lets its call go on, and exits once that call has ended."""
from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from netns_support import needs_namespaces, private_network, start, stop
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import audio_offer, caller, needs_espeak, run, say

PORT = 8080
URL = f"http://127.0.0.1:{PORT}"
pytestmark = [needs_espeak, needs_namespaces, pytest.mark.timeout(180)]


async def get(path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(URL + path) as r:
            return r.status, await r.json()


async def post_offer() -> tuple[int, dict, str | None]:
    async with aiohttp.ClientSession() as http:
        async with http.post(URL + "/api/offer", json={"sdp": await audio_offer(), "type": "offer"}) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")


@pytest.mark.parametrize("media_processes", ["0", "2"])  # one process; the front, an engine, two media processes
def test_capacity_then_a_sigterm_drain_lets_the_call_finish(tmp_path: Path, media_processes: str) -> None:
    async def main() -> None:
        private_network()
        proc = start([sys.executable, "-m", "rtc_agent.cli", "serve", "--port", str(PORT), "--max-sessions", "1",
                      "--max-answer-s", "1", "--device", "cpu", "--ice-host-address", "127.0.0.1",
                      "--media-processes", media_processes, "--turn-detection", "server_vad"], tmp_path / "serve.log")
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    status, body = await get("/capacity")
                except aiohttp.ClientError:
                    status, body = 0, {}
                if status == 200:
                    break
                assert status in (0, 503) and time.monotonic() < deadline, (status, body)
                await asyncio.sleep(0.3)
            assert body == {"status": "available", "active": 0, "free": 1, "max_sessions": 1}

            async with caller(URL) as (call, mic):
                status, body = await get("/capacity")
                assert (status, body["status"], body["free"]) == (404, "full", 0)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)
                status, body = await get("/capacity")
                assert (status, body["status"]) == (404, "draining")
                status, body, retry = await post_offer()
                assert (status, body["error"]["code"]) == (503, "draining") and retry
                await say(call, mic)  # the call in progress goes on
                done = (await call.next_event("response.done", timeout_s=40))["response"]
                assert done["status"] == "incomplete" and proc.poll() is None
            hung_up = time.monotonic()
            while proc.poll() is None and time.monotonic() - hung_up < 15:
                await asyncio.sleep(0.2)
            assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-2000:]
        finally:
            stop(proc, signal.SIGINT)

    run(main(), timeout_s=170)
