"""Offers whose peer never connects, against a real server (tiny model): real aiortc offers whose peer connection
is closed before the answer comes, so nobody answers the server's ICE checks. Such a call is never parked for a
resume (its caller never got the resume token): its slot comes back at the connect deadline
(sessions.FIRST_AUDIO_TIMEOUT_S, 8 s from the answer) or when its ICE fails; 20 of them in a row against 4 slots
keep a real caller out no longer than that; the same offer again is refused while its call holds it."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from adversary import active_calls, error_code, mangle, post_offer
from rtc_agent.client.peer import CallError
from rtc_agent.server.sessions import FIRST_AUDIO_TIMEOUT_S
from rtc_support import audio_offer, caller, needs_espeak, run, say, server, wait_ready
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
# The deadline, and what the 2-core CI machine may add: closing the call, the caller's own connect and its retry
# every 0.5 s (a parked call would hold its slot 8 + 30 s)
WITHIN_S = FIRST_AUDIO_TIMEOUT_S + 4.0


def no_resume_waits(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "for a resume" in r.getMessage()]


def test_twenty_offers_that_never_connect_keep_a_caller_out_no_longer_than_the_connect_deadline(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rtc_agent")

    async def main() -> None:
        async with server(max_sessions=4) as (url, app):
            await wait_ready(url)
            offers = [await audio_offer() for _ in range(20)]
            started = time.monotonic()
            codes = [await error_code(url, {"sdp": sdp, "type": "offer"}) for sdp in offers]
            assert codes == [(200, "")] * 4 + [(503, "server_full")] * 16
            while True:  # a real caller, trying again every 0.5 s, as a page told Retry-After would
                try:
                    async with caller(url) as (call, mic):
                        kept_out_s = time.monotonic() - started
                        await say(call, mic, "Hello, how are you?")
                        done = (await call.next_event("response.done", timeout_s=30))["response"]
                        assert done["status"] in ("completed", "incomplete") and done["metrics"]["frames_sent"] > 0
                        break
                except CallError as exc:
                    assert exc.status == 503 and time.monotonic() - started < WITHIN_S + 10, exc
                    await asyncio.sleep(0.5)
            print(f"20 offers that never connect, 4 slots: a real caller was in after {kept_out_s:.1f} s")
            assert kept_out_s <= WITHIN_S
            for _ in range(50):
                if active_calls(app) == 0:
                    break
                await asyncio.sleep(0.1)
            assert active_calls(app) == 0

    run(main(), timeout_s=200)
    ended = [r.getMessage() for r in caplog.records if "never connected" in r.getMessage()]
    assert len(ended) == 4 and not no_resume_waits(caplog), ended


def test_an_offer_nobody_connects_is_not_parked_and_the_same_offer_again_is_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rtc_agent")

    async def main() -> None:
        async with server(max_sessions=4) as (url, app):
            await wait_ready(url)
            offer = {"sdp": await audio_offer(), "type": "offer"}
            bare = {"sdp": mangle(await audio_offer(), r"a=candidate:.*", None), "type": "offer"}  # no candidates
            status, first, _ = await post_offer(url, offer)
            assert status == 200
            assert await error_code(url, offer) == (409, "duplicate_offer")
            status, second, _ = await post_offer(url, bare)
            assert status == 200 and active_calls(app) == 2
            answered = time.monotonic()
            seen = set()
            async with aiohttp.ClientSession() as http:
                while active_calls(app):
                    assert time.monotonic() - answered <= WITHIN_S, "a call that never connected held its slot"
                    for call in (first, second):
                        async with http.get(f"{url}/api/sessions/{call['session_id']}") as r:
                            seen.add((await r.json()).get("status"))
                    await asyncio.sleep(0.2)
            print(f"never connected: both slots back {time.monotonic() - answered:.1f} s after the answers")
            assert "waiting_for_resume" not in seen
            status, again, _ = await post_offer(url, offer)  # its call is gone: the offer may be answered again
            assert status == 200
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{url}/api/sessions/{again['session_id']}") as r:
                    assert r.status == 200
            assert active_calls(app) == 0

    run(main(), timeout_s=120)
    assert not no_resume_waits(caplog)
