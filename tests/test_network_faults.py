"""Calls through a bad network: 5 % loss with 50 ms of jitter, 2 % reordering, a 3 s blackout, and a connection
that dies and is resumed with the token from session.created.

Each test runs its server (the tiny model) and its aiortc caller in a private network namespace of its own
(netns_support). Loss, jitter and reordering: the server is `rtc-agent serve` as a user starts it, split into its
engine process and a media process (so that the impairer and the caller, in this process, do not share a core's
worth of the engine's interpreter), the caller goes relay-only through Debian's coturn, and its TURN
traffic passes udp_impairer (caller -> impairer -> coturn -> agent), the stand-in for `tc netem`, which this
kernel lacks; so every media packet of the call, both directions, is impaired. The blackout drops all UDP on the
namespace's loopback with nftables. Measured numbers are printed (pytest -s shows them).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest

from rtc_agent.client.microphone import Microphone
from rtc_agent.client.peer import Call, CallError, server_ice_servers
from rtc_agent.server.state import STATE

from netns_support import Faults, needs_namespaces, private_network, start, stop
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import RecordingEngine, caller, metric, metrics_text, needs_espeak, run, say, server
from test_processes import URL, until_ready
from turn_support import SECRET, TURN_PORT, coturn, needs_coturn
from udp_impairer import Impairment, UdpImpairer

pytestmark = [needs_espeak, needs_namespaces, pytest.mark.timeout(240)]
ANSWER_STEP = 3840  # RTP samples of an 80 ms answer packet
ANSWER_S = 3.0
LOSS_ANSWER_S = 6.0  # two 6 s answers: ~150 packets, so that 5 % loss rarely strays past 10 % by chance
IMPAIRER_PORT = TURN_PORT + 1


async def answer(call: Call, mic: Any, text: str = "What is the weather like in Paris today?") -> dict[str, Any]:
    """One spoken turn; the answer's response.done (after its last packet was sent)."""
    await say(call, mic, text)
    done = (await call.next_event("response.done", timeout_s=40))["response"]
    await asyncio.sleep(0.4)  # the last packets (and the encoder's flush) arrive
    return done


def answer_audio(call: Call, since: float) -> tuple[int, int]:
    """(80 ms packets received, 80 ms packets missing) among the caller's packets since `since`.

    Every packet's RTP timestamp is the previous one's plus its length (the server's stream never jumps), so a
    gap between two received packets is audio that never arrived: whole 80 ms packets inside an answer."""
    a = call.audio
    keep = [i for i, t in enumerate(a.times) if t >= since]
    received = sum(1 for i in keep if a.decoded[i] == ANSWER_STEP)
    missing = 0
    for i, j in zip(keep, keep[1:]):
        gap = a.pts[j] - a.pts[i] - a.decoded[i]
        missing += gap // ANSWER_STEP  # a lost 20 ms silence packet (960) is no answer audio
    return received, missing


async def network_loss(call: Call) -> tuple[int, int]:
    """(packets received, packets lost) of the agent's audio as the caller's RTP receiver counts them."""
    received = lost = 0
    for transceiver in call.pc.getTransceivers():
        if transceiver.kind == "audio":
            for stat in (await transceiver.receiver.getStats()).values():
                if stat.type == "inbound-rtp":
                    received, lost = received + stat.packetsReceived, lost + stat.packetsLost
    return received, lost


def report(name: str, **numbers: Any) -> None:
    print(f"\n{name}: {json.dumps(numbers)}")


def in_private_network(coro_fn: Any) -> Any:
    """Runs the test coroutine on a thread of its own that first moves into a fresh network namespace."""
    async def main() -> Any:
        private_network()
        return await coro_fn()
    return run(main(), timeout_s=200)


@contextlib.asynccontextmanager
async def impaired_call(tmp_path: Path, max_answer_s: float
                        ) -> AsyncIterator[tuple[Call, Microphone, str, UdpImpairer]]:
    """`rtc-agent serve`, coturn, the impairer in front of coturn (the TURN URL the server hands out names it),
    and a relay-only caller connected through them; yields (call, mic, server URL, impairer)."""
    async with coturn(tmp_path / "coturn.log"):
        log = tmp_path / "serve.log"
        proc = start([sys.executable, "-m", "rtc_agent.cli", "serve", "--port", URL.rsplit(":", 1)[1],
                      "--media-processes", "1", "--device", "cpu", "--ice-host-address", "127.0.0.1",
                      "--turn-detection", "server_vad", "--max-answer-s", str(max_answer_s),
                      "--turn-url", f"turn:127.0.0.1:{IMPAIRER_PORT}?transport=udp", "--turn-secret", SECRET], log)
        impairer = UdpImpairer(IMPAIRER_PORT, ("127.0.0.1", TURN_PORT))
        try:
            await until_ready(proc, log, media=1)
            async with caller(URL, ice_servers=await server_ice_servers(URL), relay_only=True) as (call, mic):
                assert call.selected_candidate_types() == ("relay", "host")  # through coturn, so the impairer
                await call.next_event("session.created", timeout_s=10)
                yield call, mic, URL, impairer
        finally:
            impairer.close()
            stop(proc, signal.SIGINT, timeout_s=30)


def answer_audio_share(call: Call, since: float, frames_sent: int) -> tuple[int, int]:
    """(received, missing) answer packets since `since`, checked against what the server sent."""
    received, missing = answer_audio(call, since)
    assert received + missing >= frames_sent  # every answer frame (plus gap fillers and flushes) is accounted for
    return received, missing


@needs_coturn
def test_answers_survive_5_percent_loss_with_50_ms_jitter_then_2_percent_reordering(tmp_path: Path) -> None:
    """One call through the impairer: two answers under loss and jitter, then one under reordering (one server
    and coturn started for both)."""
    async def main() -> None:
        async with impaired_call(tmp_path, max_answer_s=LOSS_ANSWER_S) as (call, mic, url, impairer):
            impairer.impair(Impairment(loss=0.05, delay_ms=50, jitter_ms=50))
            since = time.monotonic()
            dones = [await answer(call, mic), await answer(call, mic, "And what about tomorrow?")]
            counts = impairer.counts
            received, missing = answer_audio_share(call, since, sum(d["metrics"]["frames_sent"] for d in dones))
            rtp_received, rtp_lost = await network_loss(call)
            text = await metrics_text(url)
            input_drop = metric(text, "rtc_agent_input_audio_drop_ratio")
            report("5% loss, 50 ms jitter", answers=[d["status"] for d in dones],
                   frames_sent=sum(d["metrics"]["frames_sent"] for d in dones),
                   datagrams=counts.datagrams, dropped=counts.dropped,
                   delay_ms_p10_p50_p90=[round(counts.delay_ms_at(q)) for q in (0.1, 0.5, 0.9)],
                   packets_received=received, packets_missing=missing,
                   received_share=round(received / (received + missing), 4),
                   answer_network_loss=round(rtp_lost / max(1, rtp_received + rtp_lost), 4),
                   input_audio_drop_ratio=input_drop,
                   input_packets={o: metric(text, f'rtc_agent_input_audio_packets_total{{outcome="{o}"}}')
                                  for o in ("kept", "dropped")},
                   drop_audio_frame_ratio=metric(text, "drop_audio_frame_ratio"))
            # the impairment happened: about 5 % dropped, and the delays spread over most of 0-100 ms
            assert 0.02 < counts.dropped / counts.datagrams < 0.09
            assert counts.delay_ms_at(0.9) - counts.delay_ms_at(0.1) > 40 and counts.delay_ms_at(0.1) < 50
            assert all(d["status"] == "incomplete" and d["metrics"]["frames_sent"] > 0 for d in dones)
            assert received / (received + missing) >= 0.90
            assert missing <= rtp_lost  # cut only where the network lost packets: the receiver dropped none
            # the server dropped none of the caller's packets that arrived (jitter keeps the order, as a queue
            # does); the ones the network lost never arrived and are not counted. drop_audio_frame_ratio counts
            # answer frames the engine made too late for their slot (the network does not reach it)
            assert input_drop < 0.003
            assert metric(text, "drop_audio_frame_ratio") < 0.003
            assert call.pc.connectionState == "connected"

            impairer.impair(Impairment(reorder=0.02))
            since = time.monotonic()
            done = await answer(call, mic)
            counts = impairer.counts
            received, missing = answer_audio_share(call, since, done["metrics"]["frames_sent"])
            text = await metrics_text(url)
            report("2% reordering", datagrams=counts.datagrams, reordered=counts.reordered,
                   packets_received=received, packets_missing=missing,
                   received_share=round(received / (received + missing), 4),
                   input_audio_drop_ratio=metric(text, "rtc_agent_input_audio_drop_ratio"),
                   input_packets={o: metric(text, f'rtc_agent_input_audio_packets_total{{outcome="{o}"}}')
                                  for o in ("kept", "dropped")})
            assert counts.reordered >= 3  # the swaps happened (2 % of some 800 datagrams: 16 expected)
            assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
            assert received / (received + missing) >= 0.90
            assert call.pc.connectionState == "connected"

    in_private_network(main)


def test_a_3_s_blackout_mid_answer_and_the_call_goes_on() -> None:
    async def main() -> None:
        faults = Faults()
        async with server(max_answer_s=ANSWER_S) as (url, app), caller(url) as (call, mic):
            session_id = (await call.next_event("session.created", timeout_s=10))["session"]["id"]
            await say(call, mic)
            await call.next_event("response.created", timeout_s=20)
            faults.blackout()
            await asyncio.sleep(3.0)
            faults.clear()
            restored = time.monotonic()
            first = (await call.next_event("response.done", timeout_s=20))["response"]
            second = await answer(call, mic, "Are you still there?")
            back = next(t for t in call.audio.times if t >= restored)
            report("3 s blackout", media_back_after_ms=round((back - restored) * 1000), first=first["status"],
                   second=second["status"])
            assert second["status"] == "incomplete" and second["metrics"]["frames_sent"] > 0
            assert [first["id"], second["id"]] == ["resp_1", "resp_2"]  # one conversation, no new call
            assert [m["session"]["id"] for m in call.events_of("session.created")] == [session_id]
            assert call.audio.first_sound_after(restored) is not None
            assert len(app[STATE].sessions) == 1 and call.pc.connectionState == "connected"

    in_private_network(main)


def test_a_dead_connection_is_resumed_with_the_same_conversation() -> None:
    """The car in a tunnel: the network is gone longer than the server waits for audio, so the server parks the
    call; the caller comes back with a new peer connection and the resume token, and the conversation goes on."""
    async def main() -> None:
        faults, engine = Faults(), RecordingEngine()
        async with server(engine, max_answer_s=ANSWER_S, peer_timeout_s=2.0) as (url, app), \
                caller(url) as (call, mic):
            created = (await call.next_event("session.created", timeout_s=10))["session"]
            assert created["resume"]["window_s"] == 30.0 and call.resume_token
            first = await answer(call, mic)
            faults.blackout()
            await asyncio.sleep(4.0)  # > peer_timeout_s: the server has given up on this connection
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/api/sessions/{created['id']}") as r:
                    assert (await r.json())["status"] == "waiting_for_resume"
            faults.clear()
            started = time.monotonic()
            await call.resume(mic)
            resume_ms = (time.monotonic() - started) * 1000
            again = (await call.next_event("session.created", timeout_s=10))["session"]
            second = await answer(call, mic, "And what about tomorrow?")
            report("resume", resume_ms=round(resume_ms), second=second["status"])
            assert again["id"] == created["id"] == call.session_id
            assert [first["id"], second["id"]] == ["resp_1", "resp_2"]
            assert second["status"] == "incomplete" and second["metrics"]["frames_sent"] > 0
            assert len(engine.sessions) == 1  # the same engine session: the history is still in its cache
            assert len(app[STATE].sessions) == 1

    in_private_network(main)


def test_a_lost_call_not_resumed_in_time_ends_and_a_wrong_token_is_refused() -> None:
    async def main() -> None:
        faults = Faults()
        async with server(peer_timeout_s=1.0, resume_window_s=1.5) as (url, app), caller(url) as (call, mic):
            await call.next_event("session.created", timeout_s=10)
            faults.blackout()
            started = time.monotonic()
            while len(app[STATE].sessions) and time.monotonic() - started < 15:
                await asyncio.sleep(0.2)
            gone_s = time.monotonic() - started
            faults.clear()
            assert len(app[STATE].sessions) == 0
            assert gone_s > 2.0  # the peer timeout, then the resume window
            with pytest.raises(CallError) as refused:
                await call.resume(mic)
            assert refused.value.code == "session_not_found"
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/api/offer", json={"sdp": "v=0\r\n", "type": "offer",
                                                              "resume_token": 42}) as r:
                    assert (r.status, (await r.json())["error"]["code"]) == (400, "invalid_value")

    in_private_network(main)
