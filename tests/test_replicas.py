"""Two `rtc-agent serve` replicas (tiny model, 2 call slots each) behind Debian's HAProxy with deploy/haproxy.cfg,
all in a private network namespace: offers go only where a slot is free, a 5th caller gets 503 with Retry-After,
hang-ups reach the replica holding the call, and stopping one replica leaves the other's calls alone."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiortc import RTCPeerConnection

from rtc_agent.client.microphone import Microphone

from netns_support import needs_namespaces, private_network, start, stop
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import caller, needs_espeak, run, say

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "haproxy.cfg"
LB, REPLICAS = 8080, (8081, 8082)
pytestmark = [needs_espeak, needs_namespaces, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (apt)")]


async def capacity(port: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/capacity") as r:
            return {"http_status": r.status, **await r.json()}


async def status(port: int, session_id: str) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/api/sessions/{session_id}") as r:
            return r.status


async def wait_for(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def offer_body() -> dict[str, str]:
    pc = RTCPeerConnection()
    pc.addTrack(Microphone())
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    body = {"sdp": pc.localDescription.sdp, "type": "offer"}
    await pc.close()
    return body


def still_hearing(call: Any, since: float) -> bool:
    """The caller's server still sends (20 ms silence packets between answers never stop)."""
    return bool(call.audio.times) and call.audio.times[-1] > since


def test_four_calls_over_two_replicas_behind_haproxy(tmp_path: Path) -> None:
    async def main() -> None:
        private_network()
        replicas = [start([sys.executable, "-m", "rtc_agent.cli", "serve", "--port", str(port), "--max-sessions", "2",
                           "--max-answer-s", "1", "--device", "cpu", "--ice-host-address", "127.0.0.1"],
                          tmp_path / f"replica{i + 1}.log") for i, port in enumerate(REPLICAS)]
        env = {"RTC_AGENT_LB_BIND": f"127.0.0.1:{LB}", **{f"RTC_AGENT_REPLICA_{i + 1}": f"127.0.0.1:{port}"
                                                          for i, port in enumerate(REPLICAS)}}
        lb = start(["haproxy", "-db", "-f", str(CONFIG)], tmp_path / "haproxy.log", env)
        url = f"http://127.0.0.1:{LB}"
        try:
            async def both_available() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    return [(await capacity(p))["http_status"] for p in REPLICAS] == [200, 200]
                return False
            await wait_for(both_available, "both replicas to load the tiny model", 120)
            await asyncio.sleep(1.0)  # HAProxy's checks (every 500 ms) see them up

            async with contextlib.AsyncExitStack() as stack:
                calls = await asyncio.gather(*(stack.enter_async_context(caller(url)) for _ in range(4)))
                counts = [await capacity(p) for p in REPLICAS]
                assert [c["active"] for c in counts] == [2, 2]
                assert [c["http_status"] for c in counts] == [404, 404]  # full: HAProxy sends no new offers

                async with aiohttp.ClientSession() as http:
                    async with http.post(f"{url}/api/offer", json=await offer_body()) as r:
                        assert r.status == 503 and int(r.headers["Retry-After"]) > 0
                        assert (await r.json())["error"]["code"] == "server_full"

                await asyncio.gather(*(say(call, mic) for call, mic in calls))
                dones = await asyncio.gather(*(call.next_event("response.done", timeout_s=60) for call, _ in calls))
                assert all(d["response"]["status"] == "incomplete" for d in dones)

                # which replica holds which call (asked directly), then the same through HAProxy: each call's
                # requests reach its replica (the other would answer 404)
                holders = [[await status(p, call.session_id) for p in REPLICAS].index(200) for call, _ in calls]
                assert sorted(holders) == [0, 0, 1, 1]
                for call, _ in calls:
                    assert await status(LB, call.session_id) == 200
                gone = calls[holders.index(0)][0]
                async with aiohttp.ClientSession() as http:
                    async with http.delete(f"{url}/api/sessions/{gone.session_id}") as r:
                        assert r.status == 200, await r.text()
                await gone.close()
                assert [(await capacity(p))["active"] for p in REPLICAS] == [1, 2]

                # stop replica 1 mid-call: replica 2's calls go on and are answered
                stop(replicas[0], signal.SIGKILL)
                stopped_at = time.monotonic()
                await asyncio.sleep(1.5)
                kept = [(c, m) for (c, m), h in zip(calls, holders) if h == 1]
                assert [c for c, _ in calls if still_hearing(c, stopped_at + 1.0)] == [c for c, _ in kept]
                await asyncio.gather(*(say(call, mic, "Are you still there?") for call, mic in kept))
                for call, _ in kept:
                    done = await call.next_event("response.done", timeout_s=60)
                    assert done["response"]["status"] == "incomplete" and done["response"]["id"] == "resp_2"
                assert (await capacity(REPLICAS[1]))["active"] == 2
        finally:
            stop(lb)
            for proc in replicas:
                stop(proc, signal.SIGINT)

    run(main(), timeout_s=280)
