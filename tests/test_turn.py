"""TURN: the server hands each caller time-limited credentials for its TURN server (coturn's TURN REST scheme),
and a caller that may use relay candidates only gets through Debian's coturn, in a private network namespace."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from aioice import stun

from rtc_agent.client.microphone import Microphone
from rtc_agent.client.peer import Call, server_ice_servers
from rtc_agent.config import build_settings
from rtc_agent.media.ice import use_host_addresses
from rtc_agent.server.turn import turn_credentials

from netns_support import needs_namespaces, private_network
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import LOOPBACK, needs_espeak, run, say, server, wait_ready
from turn_support import SECRET, TURN_URL, allocate, coturn, needs_coturn



def test_turn_settings_go_together_and_take_turn_urls_only() -> None:
    with pytest.raises(ValueError, match="--turn-url and --turn-secret go together"):
        build_settings({"turn_urls": (TURN_URL,)}, env={})
    with pytest.raises(ValueError, match="no credentials"):
        build_settings({"turn_urls": ("turn:user:pass@127.0.0.1:3478",), "turn_secret": SECRET}, env={})
    env = {"RTC_AGENT_TURN_URLS": TURN_URL, "RTC_AGENT_TURN_SECRET": SECRET}
    assert build_settings({}, env=env).turn_urls == (TURN_URL,)


def test_api_config_hands_out_expiring_credentials_never_the_secret() -> None:
    async def main() -> None:
        async with server(turn_urls=(TURN_URL,), turn_secret=SECRET, turn_ttl_s=600) as (url, _):
            async with aiohttp.ClientSession() as http:
                bodies = []
                for _ in range(2):
                    async with http.get(f"{url}/api/config") as r:
                        bodies.append(await r.text())
                        turn = (await r.json())["ice_servers"][-1]
        assert all(SECRET not in body for body in bodies)
        assert turn["urls"] == [TURN_URL]
        expiry, user = turn["username"].split(":", 1)
        assert abs(int(expiry) - (time.time() + 600)) < 30 and user.startswith("caller-")
        assert turn_credentials(SECRET, 600, user, now=int(expiry) - 600) == (turn["username"], turn["credential"])
        assert bodies[0] != bodies[1]  # each caller gets credentials of its own

    run(main())


@needs_espeak
@needs_coturn
@needs_namespaces
def test_a_relay_only_caller_talks_through_coturn(tmp_path: Path) -> None:
    async def main() -> None:
        private_network()
        async with coturn(tmp_path / "coturn.log"), \
                server(turn_urls=(TURN_URL,), turn_secret=SECRET, max_answer_s=1.0) as (url, _):
            await wait_ready(url)
            use_host_addresses(LOOPBACK)
            call = Call(url, ice_servers=await server_ice_servers(url), relay_only=True)
            mic = Microphone()
            try:
                await call.connect(mic)
                # the caller's side of the pair is its coturn relay; the agent's is its own host address
                assert call.selected_candidate_types() == ("relay", "host")
                await call.next_event("session.created", timeout_s=10)
                await say(call, mic)
                done = (await call.next_event("response.done", timeout_s=30))["response"]
                assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
                await asyncio.sleep(0.3)
                assert call.audio.first_sound_after(0.0) is not None
            finally:
                await call.hang_up()

    run(main())


@needs_coturn
@needs_namespaces
def test_coturn_refuses_expired_or_forged_credentials(tmp_path: Path) -> None:
    async def main() -> None:
        private_network()
        async with coturn(tmp_path / "coturn.log"):  # it has taken fresh credentials by now
            expired = turn_credentials(SECRET, 60, "late", now=time.time() - 120)
            forged = turn_credentials("not-the-secret", 60, "forger")
            for username, password in (expired, forged):
                with pytest.raises(stun.TransactionFailed) as refused:
                    await allocate(username, password)
                assert refused.value.response.attributes["ERROR-CODE"][0] == 401

    run(main())
