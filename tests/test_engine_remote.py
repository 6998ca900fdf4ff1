"""The engine across the process boundary (engine/ipc/: host.py, remote.py, wire.py), on the real tiny
engine: errors cross as the same exceptions and leave the session usable, a media process that goes away gives
its slots back, and a process of another protocol version is refused."""
from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from rtc_support import engine, hosted, run

from rtc_agent.engine import EngineFullError, ResponseDone, SessionOptions, SpeechFrame
from rtc_agent.engine.ipc import wire
from rtc_agent.engine.ipc.remote import RemoteEngine

OPTIONS = SessionOptions(max_answer_tokens=4, max_frames=3, seed=1)


def test_errors_cross_as_themselves_and_the_session_goes_on() -> None:
    async def main() -> None:
        async with hosted(engine()) as remote:
            session = await remote.open_session(OPTIONS)
            with pytest.raises(ValueError, match="16000 Hz"):
                await session.push_audio(np.zeros(800, np.float32), sample_rate=8000)
            with pytest.raises(ValueError, match="unknown voice"):
                session.update(voice="nobody")  # checked here, before anything is sent
            await session.push_audio(np.zeros(16000, np.float32), urgent=True)
            events = [event async for event in session.respond()]
            assert isinstance(events[-1], ResponseDone) and any(isinstance(e, SpeechFrame) for e in events)
            frame = next(e for e in events if isinstance(e, SpeechFrame))
            assert frame.samples.dtype == np.float32 and frame.samples.shape == (1920,)
            await session.close()
            with pytest.raises(RuntimeError, match="closed"):
                await session.push_audio(np.zeros(1600, np.float32))

    run(main())


def test_a_departed_media_process_gives_its_slots_back_and_a_full_engine_says_so() -> None:
    async def main() -> None:
        async with hosted(engine()) as remote:
            slots = engine().pool.free
            other = await RemoteEngine(remote.path, "other").connect()
            sessions = [await other.open_session(OPTIONS) for _ in range(slots)]
            with pytest.raises(EngineFullError):
                await remote.open_session(OPTIONS)
            await sessions[0].push_audio(np.zeros(16000, np.float32))
            other._writer.transport.abort()  # the process died: no goodbye
            for _ in range(100):
                await remote.refresh()
                if remote.describe()["free_sessions"] == slots:
                    break
                await asyncio.sleep(0.05)
            assert remote.describe()["free_sessions"] == slots
            await other.close()
            session = await remote.open_session(OPTIONS)  # and they are usable again
            await session.close()

    run(main())


def test_a_media_process_of_another_protocol_version_is_refused() -> None:
    async def main() -> None:
        async with hosted(engine()) as remote:
            reader, writer = await asyncio.open_unix_connection(remote.path)
            writer.write(wire.encode(wire.Hello(wire.VERSION + 1, "future")))
            assert await asyncio.wait_for(wire.read(reader), 10) is None  # closed without a Welcome
            writer.close()

    run(main())


def test_a_departed_media_process_leaves_its_resumable_calls_to_be_taken_over() -> None:
    """A session registered as resumable outlives its media process for its window, history and slot kept, and
    another process takes it over with the token (once); the others' slots come back."""
    async def main() -> None:
        async with hosted(engine()) as remote:
            slots = engine().pool.free
            other = await RemoteEngine(remote.path, "other").connect()
            kept, brief, plain = [await other.open_session(OPTIONS) for _ in range(3)]
            kept.resumable("token-kept", 60, {"id": "sess_m0.kept"})
            brief.resumable("token-brief", 0.5, {"id": "sess_m0.brief"})
            await kept.push_audio(np.zeros(16000, np.float32))
            assert isinstance([e async for e in kept.respond()][-1], ResponseDone)
            await kept.push_audio(np.zeros(8000, np.float32))  # a turn under way when the process dies
            other._writer.transport.abort()
            for _ in range(200):  # `plain` at once, `brief` after its window; `kept` waits
                await remote.refresh()
                if remote.describe()["free_sessions"] == slots - 1:
                    break
                await asyncio.sleep(0.05)
            assert remote.describe()["free_sessions"] == slots - 1
            assert await remote.adopt("token-brief") is None and await remote.adopt("no-such-token") is None

            session, call = await remote.adopt("token-kept")
            assert call == {"id": "sess_m0.kept"} and session.options.seed == OPTIONS.seed
            assert await remote.adopt("token-kept") is None  # taken
            await remote.refresh()
            assert remote.describe()["free_sessions"] == slots - 1  # the same slot, not a new one
            await session.push_audio(np.zeros(16000, np.float32))
            assert isinstance([e async for e in session.respond()][-1], ResponseDone)
            await session.close()
            await other.close()

    run(main())


def test_a_media_process_meets_the_engines_errors_without_importing_the_model_code() -> None:
    """What a media process imports, then what its first call does with the engine's errors (signaling names
    EngineFullError; an error from the engine is unpickled by class): none of it may import the model code, which
    takes seconds of one core with the GIL held, every call of that process stopped meanwhile."""
    import subprocess
    import sys

    probe = """
import pickle, sys
import rtc_agent.conversation, rtc_agent.engine.ipc.remote, rtc_agent.server.app
from rtc_agent.engine import EngineFullError, SessionOptions, TurnTooLongError
for error in (EngineFullError("full"), TurnTooLongError("long")):
    assert type(pickle.loads(pickle.dumps(error))) is type(error)
heavy = ("transformers", "rtc_agent.engine.session.engine", "rtc_agent.engine.session.context")
print(sorted(m for m in heavy if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_a_connection_whose_writes_broke_reads_as_closed() -> None:
    """A media process that exits while the engine writes to it (as at a shutdown): the engine's next read sees
    the connection closed (the host logs a disconnect), not a BrokenPipeError."""
    async def main() -> None:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        theirs.close()
        while not writer.is_closing():
            writer.write(b"\0" * 65536)
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(wire.read(reader), 10) is None
        writer.close()

    run(main(), timeout_s=60)
