"""Resource limits: the idle limit and the maximum call length (an `error` event, then the hang-up), slow and
idle HTTP connections (slowloris), the connection cap, a trickled body, half-open TLS handshakes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

import pytest

from adversary import active_calls, still_answers
from rtc_agent.client.microphone import Microphone
from rtc_agent.client.peer import Call
from rtc_agent.media.ice import use_host_addresses
from rtc_agent.server import tls
from rtc_support import (LOOPBACK, audio_offer, caller, metric, metrics_text, needs_espeak, run, say, server,
                         settings, wait_ready)
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
SLOW_CONNECTIONS = 300


async def wait_until_no_calls(app, within_s: float) -> None:
    for _ in range(int(within_s * 10)):
        if active_calls(app) == 0:
            return
        await asyncio.sleep(0.1)
    assert active_calls(app) == 0, "the call was not ended"


def test_a_silent_caller_gets_an_idle_timeout_error_then_the_call_ends() -> None:
    async def main() -> None:
        async with server(idle_timeout_s=3.0) as (url, app), caller(url) as (call, mic):
            await say(call, mic)  # speech and its answer count as activity
            await call.next_event("response.done", timeout_s=30)
            answered_at = time.monotonic()
            err = (await call.next_event("error", timeout_s=15))["error"]
            assert err["code"] == "idle_timeout" and "3 s" in err["message"]
            assert time.monotonic() - answered_at >= 2.5  # counted from the end of the answer, not the call start
            await wait_until_no_calls(app, 5.0)

    run(main())


def test_a_call_ends_at_its_maximum_length_with_an_error_first() -> None:
    async def main() -> None:
        async with server(max_call_s=2.0, idle_timeout_s=0) as (url, app), caller(url) as (call, _):
            err = (await call.next_event("error", timeout_s=15))["error"]
            assert err["code"] == "session_expired"
            await wait_until_no_calls(app, 5.0)

    run(main())


@contextlib.asynccontextmanager
async def open_connections(host: str, port: int, first_bytes: bytes, n: int
                           ) -> AsyncIterator[list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
    conns = []
    try:
        for _ in range(n):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(first_bytes)
            conns.append((reader, writer))
        yield conns
    finally:
        for _, writer in conns:
            writer.close()


async def closed_by_server(conns, within_s: float) -> int:
    """How many of `conns` the server closes (EOF or reset) within `within_s`."""
    async def eof(reader: asyncio.StreamReader) -> bool:
        try:
            await asyncio.wait_for(reader.read(), within_s)
            return True
        except (asyncio.TimeoutError, ConnectionError):
            return False
    return sum(await asyncio.gather(*(eof(r) for r, _ in conns)))


def test_slowloris_a_valid_call_is_answered_while_300_slow_connections_are_open() -> None:
    async def main() -> None:
        async with server(request_timeout_s=6.0) as (url, app):
            await wait_ready(url)
            port = int(url.rsplit(":", 1)[1])
            partial = b"POST /api/offer HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a"
            async with open_connections("127.0.0.1", port, partial, SLOW_CONNECTIONS) as conns:
                async def trickle() -> None:  # one more header byte a second on every connection
                    for _ in range(30):
                        await asyncio.sleep(1.0)
                        for _, writer in conns:
                            if not writer.is_closing():
                                writer.write(b"a")
                dripping = asyncio.create_task(trickle())
                try:
                    await still_answers(url, app)
                    # the server gives headers request_timeout_s, then closes: every slow connection is gone
                    assert await closed_by_server(conns, 15.0) == SLOW_CONNECTIONS
                finally:
                    dripping.cancel()
            await still_answers(url, app)

    run(main(), timeout_s=200)


def test_connections_beyond_the_cap_are_closed_at_once_and_a_slow_body_gets_408() -> None:
    async def main() -> None:
        async with server(max_connections=20, request_timeout_s=2.0) as (url, app):
            await wait_ready(url)
            port = int(url.rsplit(":", 1)[1])
            async with open_connections("127.0.0.1", port, b"", 40) as conns:
                refused = await closed_by_server(conns, 1.0)  # (well before the 2 s header timeout)
                assert refused >= 19, refused
            assert metric(await metrics_text(url), "rtc_agent_connections_refused_total") >= 19
            body = json.dumps({"sdp": await audio_offer(), "type": "offer"}).encode()
            head = (f"POST /api/offer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            async with open_connections("127.0.0.1", port, head + body[:100], 1) as [(reader, _)]:
                answer = await asyncio.wait_for(reader.readuntil(b"}}"), 10.0)  # the rest never comes
            status_line, _, rest = answer.partition(b"\r\n")
            assert b" 408 " in status_line and b'"request_timeout"' in rest
            assert active_calls(app) == 0
            await still_answers(url, app)

    run(main(), timeout_s=150)


def test_half_open_tls_handshakes_do_not_keep_a_call_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tls, "CACHE", tmp_path)

    async def main() -> None:
        context = tls.server_context(settings(self_signed=True))
        async with server(ssl_context=context) as (url, app):
            await wait_ready(url, verify_tls=False)  # (its warm-up is not what the slow handshakes should delay)
            port = int(url.rsplit(":", 1)[1])
            hello_start = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"  # a ClientHello that never ends
            async with open_connections("127.0.0.1", port, hello_start, SLOW_CONNECTIONS):
                use_host_addresses(LOOPBACK)
                mic, call = Microphone(), Call(url, verify_tls=False)
                try:
                    await call.connect(mic)
                    await say(call, mic)
                    done = (await call.next_event("response.done", timeout_s=30))["response"]
                    assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
                finally:
                    await call.hang_up()
            await wait_until_no_calls(app, 5.0)

    run(main(), timeout_s=150)
