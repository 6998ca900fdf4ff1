"""The engine's side of the process split: serves one loaded `Engine` to media processes over a Unix socket.

Each media process holds one connection and opens a session per call on it. Requests run as tasks on this
process's event loop in the order they arrive, each task queuing its work on the engine's worker in its first
step, so a call's work keeps its order (an answer asked for right after its preparation, before that is done,
starts after it) while a cancel reaches an answer that is still streaming, as in one process. A media process
that goes away (a crash, kill -9) closes its connection: its requests stop, and each session it held is closed
(its slot goes back to the engine) unless its call can be resumed (`resumable`: the call's resume token and
window). Such a session waits that window, history and slot kept, for another media process to `adopt` it with
the token, which its caller brings there in a resume offer.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from ...loop_lag import watched_process
from ..options import SessionOptions
from ..session.engine import Engine, Session
from . import wire
from .session_protocol import ENGINE_CALLS, NOTICES, SESSION_CALLS, Crossing

log = logging.getLogger(__name__)


@dataclass
class _Orphan:
    """A session whose media process died, waiting for its caller to resume the call in another."""

    session: Session
    registered: dict[str, Any]  # what its media process registered with `resumable`: token, window_s, call
    expiry: asyncio.TimerHandle


class EngineHost:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()  # this process's page of the server's /metrics (front.py merges them)
        self.loop_lag, self.gc_pauses = watched_process(self.registry)
        self._server: asyncio.AbstractServer | None = None
        self._orphans: dict[str, _Orphan] = {}  # by resume token

    async def start(self, path: str | Path) -> None:
        """Warms the engine up if it is not yet, then listens on `path` (a socket file in a private directory)."""
        if not self.engine.ready:
            await self.engine.warmup()
        self._server = await asyncio.start_unix_server(self._serve, str(path))
        os.chmod(path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        orphans, self._orphans = list(self._orphans.values()), {}
        for orphan in orphans:
            orphan.expiry.cancel()
            await _close_quietly(orphan.session)

    def keep(self, session: Session, registered: dict[str, Any]) -> None:
        """Hold the session of a departed media process for `registered["window_s"]` (then close it)."""
        token, window_s = registered["token"], registered["window_s"]
        expiry = asyncio.get_running_loop().call_later(window_s, self._expire, token)
        self._orphans[token] = _Orphan(session, registered, expiry)
        log.info("a session of a departed media process waits %g s for its caller to resume", window_s)

    def adopt(self, token: str) -> _Orphan | None:
        """The orphan with this resume token, no longer waiting (None: no such session)."""
        orphan = self._orphans.pop(token, None)
        if orphan is not None:
            orphan.expiry.cancel()
        return orphan

    def _expire(self, token: str) -> None:
        orphan = self._orphans.pop(token, None)
        if orphan is not None:
            asyncio.ensure_future(_close_quietly(orphan.session))

    def status(self) -> dict[str, Any]:
        """What media processes show: the engine's description, whether it is ready, its GPU memory."""
        engine = self.engine
        return {"describe": engine.describe(), "ready": engine.ready, "memory": engine.memory()}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(self, writer)
        try:
            hello = await wire.read(reader)
            if not isinstance(hello, wire.Hello) or hello.version != wire.VERSION:
                log.error("a media process spoke another protocol (%r); refused", hello)
                return
            writer.write(wire.encode(wire.Welcome(wire.VERSION)))
            log.info("media process %s connected", hello.name)
            while (record := await wire.read(reader)) is not None:
                connection.handle(record)
            log.info("media process %s disconnected", hello.name)
        except Exception:
            log.exception("the connection of a media process failed")
        finally:
            await connection.close()
            writer.close()


class _Connection:
    """One media process: its sessions, and its requests in flight."""

    def __init__(self, host: EngineHost, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.writer = writer
        self.sessions: dict[int, Session] = {}
        self.resumable: dict[int, dict[str, Any]] = {}  # session number -> its call's resume token, window, ids
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._numbers = itertools.count(1)

    def send(self, record: Any) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.encode(record))

    def handle(self, record: Any) -> None:
        if isinstance(record, wire.Request):
            task = asyncio.ensure_future(self._run(record))
            self.tasks[record.id] = task
            task.add_done_callback(lambda _: self.tasks.pop(record.id, None))
        elif isinstance(record, wire.Notice) and record.method in NOTICES:
            session = self.sessions.get(record.session)
            if session is not None:
                NOTICE_HANDLERS[record.method](self, record.session, session, record.kwargs)
        elif isinstance(record, wire.Stop):
            task = self.tasks.get(record.id)
            if task is not None:
                task.cancel()
        else:
            raise wire.WireError(f"unexpected record {type(record).__name__}")

    async def _run(self, request: wire.Request) -> None:
        try:
            value = await self._call(request)
        except asyncio.CancelledError:  # a stream its reader stopped: closed like an abandoned generator
            self.send(wire.Result(request.id))
            return
        except Exception as exc:
            self.send(wire.Result(request.id, error=wire.portable(exc)))
            return
        self.send(wire.Result(request.id, value))

    async def _call(self, request: wire.Request) -> Any:
        method = request.method
        if method in ENGINE_CALLS:
            return await ENGINE_HANDLERS[method](self, *request.args)
        session = self.sessions.get(request.session)  # type: ignore[arg-type]
        if session is None:
            raise RuntimeError("this session is closed")
        crossing = SESSION_CALLS.get(method)
        if crossing is Crossing.STREAM:
            events = getattr(session, method)()
            try:
                async for event in events:
                    self.send(wire.Streamed(request.id, event))
            finally:
                await events.aclose()
            return None
        if crossing is not Crossing.REQUEST:
            raise ValueError(f"no engine method {method!r}")
        if method == "close":
            self._forget(request.session)  # type: ignore[arg-type]
        return await getattr(session, method)(*request.args, **request.kwargs)

    # ---- the engine's own requests (session_protocol.ENGINE_CALLS) ----------------------------------------
    async def _status(self) -> dict[str, Any]:
        return self.host.status()

    async def _metrics(self) -> str:
        return generate_latest(self.host.registry).decode()

    async def _score_turn(self, audio: np.ndarray) -> tuple[float, float]:
        return await self.host.engine.score_turn(audio)

    async def _new_session(self, options: SessionOptions) -> int:
        return self._add(self.host.engine.new_session(options))

    async def _adopt(self, token: str) -> dict[str, Any] | None:
        orphan = self.host.adopt(token)
        if orphan is None:
            return None
        try:
            await orphan.session.abort_turn()  # the new process starts listening afresh
        except Exception:
            await _close_quietly(orphan.session)
            raise
        number = self._add(orphan.session)
        self.resumable[number] = orphan.registered
        return {"number": number, "options": orphan.session.options, "call": orphan.registered["call"]}

    # ---- notices (session_protocol.NOTICES) ---------------------------------------------------------------
    def _update(self, number: int, session: Session, changes: dict[str, Any]) -> None:
        try:
            session.update(**changes)  # checked by the media process already
        except ValueError:
            log.exception("a session update the media process let through was refused")

    def _resumable(self, number: int, session: Session, registered: dict[str, Any]) -> None:
        self.resumable[number] = registered

    def _dropped(self, number: int, session: Session, _: dict[str, Any]) -> None:
        """A session its media process dropped without closing it."""
        self._forget(number)
        asyncio.ensure_future(session.close())

    def _add(self, session: Session) -> int:
        number = next(self._numbers)
        self.sessions[number] = session
        return number

    def _forget(self, number: int) -> None:
        self.sessions.pop(number, None)
        self.resumable.pop(number, None)

    async def close(self) -> None:
        """The media process is gone: its requests stop; its sessions close (their slots go back), but those of
        calls that can be resumed wait for it in another media process."""
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        sessions, self.sessions = self.sessions, {}
        for number, session in sessions.items():
            if (registered := self.resumable.get(number)) is not None and registered["window_s"] > 0:
                self.host.keep(session, registered)
            else:
                await _close_quietly(session)
        self.resumable = {}


# The dispatch tables: one entry per name of session_protocol.ENGINE_CALLS and of session_protocol.NOTICES (a
# session's requests go to its method of that name, as session_protocol.SESSION_CALLS says they cross).
ENGINE_HANDLERS: dict[str, Callable[..., Awaitable[Any]]] = {
    "status": _Connection._status, "metrics": _Connection._metrics, "score_turn": _Connection._score_turn,
    "new_session": _Connection._new_session, "adopt": _Connection._adopt}
NOTICE_HANDLERS: dict[str, Callable[[_Connection, int, Session, dict[str, Any]], None]] = {
    "update": _Connection._update, "resumable": _Connection._resumable, "close": _Connection._dropped}


async def _close_quietly(session: Session) -> None:
    try:
        await session.close()
    except Exception:
        log.exception("closing a session of a departed media process failed")


async def serve_engine(engine: Engine, path: str | Path, started: float | None = None) -> None:
    """Warms `engine` up, then serves it on `path` until cancelled (the engine process's main)."""
    host = EngineHost(engine)
    lag = asyncio.create_task(host.loop_lag.watch(), name="loop-lag")
    host.gc_pauses.install()
    try:
        await host.start(path)
        log.info("engine serving on %s%s", path,
                 f" ({time.monotonic() - started:.1f} s after start)" if started is not None else "")
        await asyncio.Event().wait()
    finally:
        lag.cancel()
        await host.close()
