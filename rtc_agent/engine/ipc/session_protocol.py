"""The engine session's interface, defined once: what a conversation calls on its call's engine session, whether
the engine runs in this process (`engine.Session`) or in the engine process (`remote.RemoteSession`, sending the
records of wire.py that `host.py` dispatches).

`EngineSession` is the interface. `SESSION_CALLS` says how each of its methods crosses the process boundary;
`ENGINE_CALLS` and `NOTICES` name the requests and notices that are not a session method's. The host's dispatch is
built from these tables, and tests/test_session_protocol.py checks that `engine.Session`, `RemoteSession` and the
host agree with them: adding a method means adding it here, to `engine.Session` and to `RemoteSession`.
"""
from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from typing import Any, Protocol

import numpy as np

from ..events import INPUT_SAMPLE_RATE, Event
from ..options import SessionOptions


class Crossing(enum.Enum):
    """How a call crosses to the engine process."""

    REQUEST = "request"  # a wire.Request; its wire.Result carries the value or the exception
    STREAM = "stream"  # a wire.Request answered by wire.Streamed events, then a wire.Result
    NOTICE = "notice"  # a one-way wire.Notice, applied in order with the requests around it


class EngineSession(Protocol):
    """One call's engine session. Each call's work is queued (or its request sent) before the coroutine first
    waits, so that calls started one after another run in that order in the engine: `prepare_answer` is not
    awaited before the calls after it."""

    options: SessionOptions  # as the engine resolved them (engine.Session), or as asked (RemoteSession)

    async def push_audio(self, samples: np.ndarray, sample_rate: int = INPUT_SAMPLE_RATE,
                         at: float | None = None, urgent: bool = False) -> None: ...
    async def push_image(self, image: np.ndarray, at: float) -> None: ...
    async def push_text(self, text: str) -> None: ...
    async def push_tool_output(self, output: str) -> None: ...
    async def abort_turn(self) -> None: ...
    async def flush(self) -> None: ...
    async def prepare_answer(self) -> None: ...
    def respond(self) -> AsyncIterator[Event]: ...
    async def cancel(self, frames_played: int | None = None) -> None: ...
    async def limit_video(self, window_s: int) -> int | None: ...
    def update(self, **changes: Any) -> None: ...
    async def close(self) -> None: ...


SESSION_CALLS: dict[str, Crossing] = {
    "push_audio": Crossing.REQUEST,
    "push_image": Crossing.REQUEST,
    "push_text": Crossing.REQUEST,
    "push_tool_output": Crossing.REQUEST,
    "abort_turn": Crossing.REQUEST,
    "flush": Crossing.REQUEST,
    "prepare_answer": Crossing.REQUEST,
    "respond": Crossing.STREAM,
    "cancel": Crossing.REQUEST,
    "limit_video": Crossing.REQUEST,
    "update": Crossing.NOTICE,  # checked by the media process first (RemoteSession.update), so nothing to answer
    "close": Crossing.REQUEST,
}
# Requests to the engine itself (wire.Request with no session).
ENGINE_CALLS = frozenset({"status", "metrics", "score_turn", "new_session", "adopt"})
# Notices to a session: its `update`; `resumable` (RemoteSession only: keep the session if this media process
# dies); `close` (a RemoteSession dropped without close(): its slot goes back).
NOTICES = frozenset({name for name, crossing in SESSION_CALLS.items() if crossing is Crossing.NOTICE}
                    | {"resumable", "close"})
