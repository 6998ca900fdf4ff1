"""The records that cross between the engine process and the media processes (engine/ipc/host.py, engine/ipc/remote.py).

Each record is a frozen dataclass, pickled (protocol 5) behind a 4-byte length, over a Unix socket in a directory
only the server's user can read: both ends are the same program, so pickle is a format, not a trust boundary.
Why a socket and pickle rather than shared-memory rings: what crosses per call is small and slow (a 32 ms chunk of
16 kHz audio is 2 KB, 31 a second; an 80 ms answer frame 7.5 KB, 12.5 a second; a scaled camera frame at most
442 KB, 2 a second). Copying such a record costs well under a microsecond per KB; what a record costs is the
system call and the event loop's wake-up on each side, which a ring would need as well to say that data is there.
`VERSION` is checked when a media process connects: two builds that disagree on a record refuse each other.
"""
from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

VERSION = 6
MAX_RECORD_BYTES = 64 << 20
_LENGTH = struct.Struct("!I")


@dataclass(frozen=True)
class Hello:
    """A media process connects (first record)."""

    version: int
    name: str  # which process, for the engine's log


@dataclass(frozen=True)
class Welcome:
    """The engine's answer to Hello."""

    version: int


@dataclass(frozen=True)
class Request:
    """Run `method` (of the engine, or of session `session`) with these arguments; a Result with `id` answers it.
    A stream (`respond`) sends Streamed records first."""

    id: int
    method: str
    session: int | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Notice:
    """A one-way request to a session, applied in order with the requests around it (no Result)."""

    session: int
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Streamed:
    """One event of the stream that request `id` opened."""

    id: int
    event: Any


@dataclass(frozen=True)
class Stop:
    """The media process stopped reading stream `id`: end it (as closing the generator in one process does)."""

    id: int


@dataclass(frozen=True)
class Result:
    """Request `id` is done: its value, or the exception it raised."""

    id: int
    value: Any = None
    error: BaseException | None = None


class WireError(ConnectionError):
    """The other process sent something that is not a record of this version."""


def encode(record: Any) -> bytes:
    body = pickle.dumps(record, protocol=5)
    return _LENGTH.pack(len(body)) + body


async def read(reader: asyncio.StreamReader) -> Any | None:
    """The next record, or None when the other side closed the connection."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_RECORD_BYTES:
            raise WireError(f"a record of {length} bytes (at most {MAX_RECORD_BYTES})")
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):  # (BrokenPipeError: a write to it failed as it went)
        return None


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (its class and message), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=5))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
