"""An ended call is freed by reference counting alone, the moment it ends: with Python's cyclic GC switched off,
nothing of the server's side of six calls (two of them answered) is left once they have hung up. (With the GC
on, leftovers would only show as slow growth: see the soak.)"""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest

from rtc_agent.server.state import STATE
from rtc_support import caller, needs_espeak, run, say, server, wait_ready
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(180)]


def server_side(call: Any) -> list[Any]:
    """The call's objects that used to live on in reference cycles: the call, its peer connection and its
    transports, the caller's audio track, the outbound track, the conversation, the engine session, the VAD."""
    pc = call.pc
    received = [t.receiver.track for t in pc.getTransceivers() if t.receiver.track is not None]
    transports = [t.receiver.transport for t in pc.getTransceivers()]
    return [call, pc, *received, *transports, call.track, call.conversation, call.conversation.session]


def test_ended_calls_are_freed_without_the_cyclic_gc() -> None:
    async def main() -> None:
        async with server() as (url, app):
            await wait_ready(url)
            refs: list[weakref.ref[Any]] = []
            gc.collect()
            gc.disable()
            try:
                for i in range(6):
                    async with caller(url) as (call, mic):
                        refs += [weakref.ref(o) for o in server_side(app[STATE].sessions.get(call.session_id))]
                        if i % 3 == 0:
                            await say(call, mic, "Hello there.")
                            await call.next_event("response.done", timeout_s=30)
                    await asyncio.sleep(0.2)
                left = [type(r()).__name__ for r in refs if r() is not None]
            finally:
                gc.enable()
            assert len(refs) >= 6 * 7 and not left, left

    run(main())
