"""The media side of the process split: an engine in another process (engine/ipc/host.py), used as the server uses an
`Engine` in its own process. `RemoteEngine` is one connection per media process; `RemoteSession` one call on it,
with the methods a conversation needs (session_protocol.EngineSession), each crossing as
session_protocol.SESSION_CALLS says and run by the engine as the in-process session would. If the engine process
dies, every request fails with `EngineUnavailable` and `ready` turns False: the server refuses new calls with a
503 and /readyz says why.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..events import INPUT_SAMPLE_RATE, Event
from ..model.memory import MemoryUse
from ..options import SessionOptions
from . import wire

log = logging.getLogger(__name__)
STATUS_EVERY_S = 0.5  # the engine's description, memory and free slots are read this often


class EngineUnavailable(RuntimeError):
    """The engine process is gone (or never answered)."""


class RemoteEngine:
    def __init__(self, path: str | Path, name: str = f"media-{os.getpid()}") -> None:
        self.path = str(path)
        self.name = name
        self.lost: str | None = None  # why the engine is unreachable, once it is
        self._status: dict[str, Any] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self, timeout_s: float = 10.0) -> "RemoteEngine":
        """Opens the connection (retrying while the engine process starts its socket) and reads the status."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if asyncio.get_running_loop().time() > deadline:
                    raise EngineUnavailable(f"no engine process listens on {self.path}") from None
                await asyncio.sleep(0.1)
        self._writer.write(wire.encode(wire.Hello(wire.VERSION, self.name)))
        welcome = await asyncio.wait_for(wire.read(reader), timeout_s)
        if not isinstance(welcome, wire.Welcome):
            raise EngineUnavailable(f"the engine process refused this one (protocol version {wire.VERSION})")
        self._tasks.append(asyncio.create_task(self._read(reader), name="engine-replies"))
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._watch_status(), name="engine-status"))
        return self

    # ---- what the server reads (cached: the event loop never waits for the engine to answer these) ---------
    @property
    def ready(self) -> bool:
        return self.lost is None and bool(self._status.get("ready"))

    def describe(self) -> dict[str, Any]:
        return {**self._status.get("describe", {}), "ready": self.ready}

    def memory(self) -> MemoryUse | None:
        return self._status.get("memory")

    async def metrics_page(self) -> str:
        """The engine process's own metrics (Prometheus text): its CPU, memory, event loop and collections."""
        return await self.request("metrics")

    async def score_turn(self, audio: np.ndarray) -> tuple[float, float]:
        """The engine's end-of-turn verdict on a turn's audio (Engine.score_turn)."""
        return await self.request("score_turn", None, audio)

    async def open_session(self, options: SessionOptions = SessionOptions()) -> "RemoteSession":
        """A session on a free slot of the engine; `EngineFullError` when every slot is taken."""
        number = await self.request("new_session", None, options)
        return RemoteSession(self, number, options)

    async def adopt(self, token: str) -> tuple["RemoteSession", dict[str, Any]] | None:
        """The session of a call whose media process died, waiting with this resume token (`RemoteSession.
        resumable`), now this process's; with what that process registered of the call. None: no such call."""
        adopted = await self.request("adopt", None, token)
        if adopted is None:
            return None
        return RemoteSession(self, adopted["number"], adopted["options"]), adopted["call"]

    # ---- requests ---------------------------------------------------------------------------------------------
    def _send(self, record: Any) -> None:
        if self.lost is not None or self._writer is None:
            raise EngineUnavailable(f"the engine process is unavailable: {self.lost or 'not connected'}")
        self._writer.write(wire.encode(record))

    async def request(self, method: str, session: int | None = None, *args: Any, **kwargs: Any) -> Any:
        id_ = next(self._ids)
        future = self._pending[id_] = asyncio.get_running_loop().create_future()
        try:
            self._send(wire.Request(id_, method, session, args, kwargs))
            return await future
        finally:
            self._pending.pop(id_, None)

    def notify(self, session: int, method: str, **kwargs: Any) -> None:
        try:
            self._send(wire.Notice(session, method, kwargs))
        except EngineUnavailable:
            pass

    async def stream(self, session: int, method: str) -> AsyncIterator[Event]:
        id_ = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[id_] = queue
        finished = False
        try:
            self._send(wire.Request(id_, method, session))
            while True:
                record = await queue.get()
                if isinstance(record, wire.Result):
                    finished = True
                    if record.error is not None:
                        raise record.error
                    return
                yield record
        finally:
            self._streams.pop(id_, None)
            if not finished and self.lost is None:
                self._send(wire.Stop(id_))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "its connection closed"
        try:
            while (record := await wire.read(reader)) is not None:
                if isinstance(record, wire.Streamed):
                    if (queue := self._streams.get(record.id)) is not None:
                        queue.put_nowait(record.event)
                elif isinstance(record, wire.Result):
                    if (queue := self._streams.get(record.id)) is not None:
                        queue.put_nowait(record)
                    elif (future := self._pending.get(record.id)) is not None and not future.done():
                        if record.error is not None:
                            future.set_exception(record.error)
                        else:
                            future.set_result(record.value)
        except Exception as exc:
            reason = f"its connection failed: {exc!r}"
        self._lose(f"the engine process is gone ({reason})")

    def _lose(self, reason: str, expected: bool = False) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        if not expected:
            log.error("%s: calls in progress fail, new calls are refused", reason)
        error = EngineUnavailable(reason)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for queue in self._streams.values():
            queue.put_nowait(wire.Result(0, error=error))

    async def refresh(self) -> None:
        """Reads the engine's status now (free slots, memory) rather than as of the last poll."""
        self._status = await self.request("status")

    async def _watch_status(self) -> None:
        while self.lost is None:
            await asyncio.sleep(STATUS_EVERY_S)
            try:
                await self.refresh()
            except EngineUnavailable:
                return

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
        self._lose("the connection was closed", expected=True)


class RemoteSession:
    """One call's engine session in the engine process: session_protocol.EngineSession, as requests and notices."""

    def __init__(self, engine: RemoteEngine, number: int, options: SessionOptions) -> None:
        self.engine = engine
        self.number = number
        self.options = options
        self.closed = False
        # a session dropped without close() still gives its slot back
        self._release = weakref.finalize(self, engine.notify, number, "close")

    def update(self, **changes: Any) -> None:
        """Change voice, instructions or sampling from the next turn on (ValueError here, for bad values)."""
        self.options = replace(self.options, **changes)
        self.engine.notify(self.number, "update", **changes)

    def resumable(self, token: str, window_s: float, call: dict[str, Any]) -> None:
        """If this process dies, the engine keeps the session `window_s` for another media process to `adopt`
        with `token`; `call`: what that process is told of the call (its id, for the log)."""
        self.engine.notify(self.number, "resumable", token=token, window_s=window_s, call=call)

    async def _request(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise RuntimeError("this session is closed")
        return await self.engine.request(method, self.number, *args, **kwargs)

    async def push_audio(self, samples: np.ndarray, sample_rate: int = INPUT_SAMPLE_RATE,
                         at: float | None = None, urgent: bool = False) -> None:
        await self._request("push_audio", samples, sample_rate, at, urgent)

    async def push_image(self, image: np.ndarray, at: float) -> None:
        await self._request("push_image", image, at)

    async def push_text(self, text: str) -> None:
        await self._request("push_text", text)

    async def push_tool_output(self, output: str) -> None:
        await self._request("push_tool_output", output)

    async def flush(self) -> None:
        await self._request("flush")

    async def prepare_answer(self) -> None:
        await self._request("prepare_answer")

    async def abort_turn(self) -> None:
        await self._request("abort_turn")

    async def cancel(self, frames_played: int | None = None) -> None:
        await self._request("cancel", frames_played)

    async def limit_video(self, window_s: int) -> int | None:
        return await self._request("limit_video", window_s)

    def respond(self) -> AsyncIterator[Event]:
        if self.closed:
            raise RuntimeError("this session is closed")
        return self.engine.stream(self.number, "respond")

    async def close(self) -> None:
        if self.closed:
            return
        self._release.detach()
        try:
            await self._request("close")
        except EngineUnavailable:
            pass
        finally:
            self.closed = True
