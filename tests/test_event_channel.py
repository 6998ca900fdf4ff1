"""The call's `events` data channel (server/sessions.py, EventChannel) between two real aiortc peers over
127.0.0.1: what the server says before the caller's channel is open waits for it, behind session.created."""
from __future__ import annotations

import asyncio
import json

from aiortc import RTCPeerConnection

from rtc_agent.media.ice import use_host_addresses
from rtc_agent.server.sessions import EventChannel

from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import LOOPBACK, run


def test_session_created_goes_before_the_events_that_waited_for_the_channel() -> None:
    async def main() -> None:
        use_host_addresses(LOOPBACK)
        server, client = RTCPeerConnection(), RTCPeerConnection()
        events = EventChannel()
        events.send({"type": "input_audio_buffer.speech_started"})  # (the caller's audio came before its channel)
        received: list[str] = []
        both = asyncio.Event()
        channel = client.createDataChannel("events")

        @channel.on("message")
        def on_message(message: str) -> None:
            received.append(json.loads(message)["type"])
            if len(received) == 2:
                both.set()

        server.on("datachannel", lambda ch: events.attach(ch, lambda _: None,
                                                           lambda: events.send({"type": "session.created"})))
        try:
            await client.setLocalDescription(await client.createOffer())
            await server.setRemoteDescription(client.localDescription)
            await server.setLocalDescription(await server.createAnswer())
            await client.setRemoteDescription(server.localDescription)
            await asyncio.wait_for(both.wait(), 20)
            assert received == ["session.created", "input_audio_buffer.speech_started"]
        finally:
            await client.close()
            await server.close()

    run(main(), timeout_s=60)
