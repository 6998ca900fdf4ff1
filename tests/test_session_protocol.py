"""One session interface (engine/ipc/session_protocol.py): the in-process session, the remote client and the engine
process's dispatch agree with it. Each method of `EngineSession` has the same parameters on `engine.Session` and
`RemoteSession`, crosses as `SESSION_CALLS` says, and reaches the session by its own name with its own arguments;
the host dispatches exactly the engine requests and notices the protocol names."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from rtc_support import hosted, run

from rtc_agent.engine.events import TextDelta
from rtc_agent.engine.ipc import host
from rtc_agent.engine.ipc.remote import RemoteSession
from rtc_agent.engine.ipc.session_protocol import ENGINE_CALLS, NOTICES, SESSION_CALLS, Crossing, EngineSession
from rtc_agent.engine.options import SessionOptions
from rtc_agent.engine.session.engine import Session

METHODS = sorted(name for name, value in vars(EngineSession).items() if callable(value) and not name.startswith("_"))


def parameters(function: Any) -> list[tuple[str, Any, Any]]:
    """Name, kind and default of each parameter (annotations are strings here: compared as the code reads)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_table_names_every_method_once() -> None:
    assert METHODS == sorted(SESSION_CALLS)


@pytest.mark.parametrize("implementation", [Session, RemoteSession], ids=["engine.Session", "RemoteSession"])
@pytest.mark.parametrize("name", METHODS)
def test_each_implementation_has_the_protocols_method(implementation: type, name: str) -> None:
    ours, protocol = getattr(implementation, name), getattr(EngineSession, name)
    assert parameters(ours) == parameters(protocol)
    if SESSION_CALLS[name] is Crossing.REQUEST:
        assert inspect.iscoroutinefunction(ours) and inspect.iscoroutinefunction(protocol)
    else:  # a stream returns its events' iterator, a notice returns at once: neither is awaited
        assert not inspect.iscoroutinefunction(ours) and not inspect.iscoroutinefunction(protocol)


def test_the_host_dispatches_what_the_protocol_names() -> None:
    assert set(host.ENGINE_HANDLERS) == ENGINE_CALLS
    assert set(host.NOTICE_HANDLERS) == NOTICES
    assert not ENGINE_CALLS & set(SESSION_CALLS)  # (the host looks a request's name up among the engine's first)


class RecordingSession:
    """An engine session that records what reaches it."""

    def __init__(self, options: SessionOptions, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> None:
        self.options = options
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        if SESSION_CALLS.get(name) is not Crossing.REQUEST:
            raise AttributeError(name)

        async def method(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return 7 if name == "limit_video" else None
        return method

    async def respond(self) -> AsyncIterator[TextDelta]:
        self.calls.append(("respond", (), {}))
        yield TextDelta("hello", 1)

    def update(self, **changes: Any) -> None:
        self.calls.append(("update", (), changes))
        self.options = replace(self.options, **changes)


class RecordingEngine:
    """What EngineHost needs of an engine, handing out RecordingSessions."""

    ready = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def new_session(self, options: SessionOptions) -> RecordingSession:
        return RecordingSession(options, self.calls)

    def describe(self) -> dict[str, Any]:
        return {"model": "recording", "free_sessions": 1}

    def memory(self) -> None:
        return None

    async def score_turn(self, audio: np.ndarray) -> tuple[float, float]:
        return 0.5, float(len(audio))


def test_every_call_of_the_remote_client_reaches_the_session_by_its_name() -> None:
    audio, image = np.zeros(320, np.float32), np.zeros((4, 4, 3), np.uint8)
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
        "push_audio": ((audio, 16000, 1.5, True), {}), "push_image": ((image, 2.0), {}),
        "push_text": (("hi",), {}), "push_tool_output": (("{}",), {}), "abort_turn": ((), {}), "flush": ((), {}),
        "prepare_answer": ((), {}), "respond": ((), {}), "cancel": ((3,), {}), "limit_video": ((10,), {}),
        "update": ((), {"voice": "ethan"}), "close": ((), {})}
    assert sorted(calls) == METHODS  # a new method needs its line here too

    async def main() -> None:
        engine = RecordingEngine()
        async with hosted(engine) as remote:
            assert remote.describe()["model"] == "recording"  # status
            assert await remote.score_turn(audio) == (0.5, 320.0)
            assert "# HELP" in await remote.metrics_page()
            session = await remote.open_session(SessionOptions())
            answers = {}
            for name, (args, kwargs) in calls.items():
                value = getattr(session, name)(*args, **kwargs)
                if SESSION_CALLS[name] is Crossing.STREAM:
                    answers[name] = [event async for event in value]
                elif SESSION_CALLS[name] is Crossing.REQUEST:
                    answers[name] = await value
            for _ in range(100):  # a notice has no answer: wait for it to be applied
                if any(name == "update" for name, _, _ in engine.calls):
                    break
                await asyncio.sleep(0.01)
            assert await remote.adopt("no such token") is None
        assert answers["respond"] == [TextDelta("hello", 1)] and answers["limit_video"] == 7
        reached = {name: (args, kwargs) for name, args, kwargs in engine.calls}
        assert sorted(reached) == METHODS
        for name, (args, kwargs) in calls.items():
            got_args, got_kwargs = reached[name]
            assert got_kwargs == kwargs, name
            assert len(got_args) == len(args) and all(np.array_equal(a, b) for a, b in zip(got_args, args)), name

    run(main())
