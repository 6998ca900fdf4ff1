"""The adversarial HTTP input of test_adversarial_http.py against the front of the process split (a real
`rtc-agent serve --media-processes 2 --token`, in a private network namespace): the same statuses and JSON error
codes as one process, a body nested 50 000 deep refused before auth, never a 500 nor a traceback in the log;
offers whose peer never connects give their slots back at the connect deadline; the same offer made twice is
refused; a normal call still gets its spoken answer."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from adversary import error_code, post_offer
from netns_support import needs_namespaces, private_network, start, stop
from rtc_support import audio_offer, caller, needs_espeak, run, say
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from test_adversarial_connect import WITHIN_S
from test_adversarial_http import check_authorization_headers, check_unreadable_bodies, refused_as_listed

PORT = 8080
URL = f"http://127.0.0.1:{PORT}"
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLOTS = 4
pytestmark = [needs_espeak, needs_namespaces, pytest.mark.timeout(300)]


async def capacity() -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{URL}/capacity") as r:
            return r.status, await r.json()


async def until_ready(proc: object, log: Path, timeout_s: float = 150) -> None:
    """Until /readyz is 200 with both media processes ready."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(f"{URL}/readyz") as r:
                    if r.status == 200 and (await r.json())["media_processes_ready"] == 2:
                        return
            except aiohttp.ClientError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]  # type: ignore[attr-defined]
            await asyncio.sleep(0.3)


def test_the_front_refuses_bad_input_as_one_process_does(tmp_path: Path) -> None:
    async def main() -> None:
        private_network()
        log = tmp_path / "serve.log"
        proc = start([sys.executable, "-m", "rtc_agent.cli", "serve", "--port", str(PORT), "--media-processes", "2",
                      "--max-sessions", str(SLOTS), "--max-answer-s", "1", "--token", TOKEN, "--device", "cpu",
                      "--ice-host-address", "127.0.0.1", "--turn-detection", "server_vad"], log)
        try:
            await until_ready(proc, log)
            good = await audio_offer()
            await refused_as_listed(URL, good, AUTH)
            deep = b"[" * 50_000 + b"]" * 50_000
            for headers, refused in (({}, (401, "unauthorized")),
                                     ({"Authorization": "Bearer wrong"}, (401, "unauthorized")),
                                     ({**AUTH, "Content-Type": "text/plain"}, (415, "unsupported_media_type")),
                                     ({**AUTH, "Origin": "https://evil.example"}, (403, "origin_not_allowed")),
                                     ({"Authorization": f"bearer {TOKEN}"}, (400, "invalid_json"))):
                assert await error_code(URL, raw=deep, headers=headers) == refused, headers
            await check_authorization_headers(URL, TOKEN, json.dumps({"sdp": good, "type": "offer"}).encode())
            await check_unreadable_bodies(URL, TOKEN)

            # offers whose peer never connects (their peer connections are closed): every slot, then none held
            offers = [{"sdp": await audio_offer(), "type": "offer"} for _ in range(SLOTS)]
            for offer in offers:
                status, _, _ = await post_offer(URL, offer, headers=AUTH)
                assert status == 200
            answered = time.monotonic()
            assert await error_code(URL, offers[0], headers=AUTH) == (409, "duplicate_offer")
            assert await error_code(URL, {"sdp": good, "type": "offer"}, headers=AUTH) == (503, "server_full")
            while (await capacity())[1]["free"] < SLOTS:
                assert time.monotonic() - answered <= WITHIN_S, await capacity()
                await asyncio.sleep(0.2)
            print(f"split layout: {SLOTS} offers that never connect, slots back {time.monotonic() - answered:.1f} s "
                  "after the last answer")

            async with caller(URL, token=TOKEN) as (call, mic):
                await say(call, mic, "Hello, how are you?")
                done = (await call.next_event("response.done", timeout_s=30))["response"]
                assert done["status"] in ("completed", "incomplete") and done["metrics"]["frames_sent"] > 0
                assert not call.events_of("error")
            text = log.read_text()
            assert "Traceback" not in text and not re.search(r" 500 [\d.]+ ms", text), text[-3000:]
        finally:
            stop(proc, signal.SIGINT)

    run(main(), timeout_s=280)
