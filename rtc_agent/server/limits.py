"""The HTTP server's own limits against slow and flooding clients (slowloris, half-open TLS, connection floods).

- aiohttp's keepalive_timeout also runs from the moment a connection is accepted until its first request is
  complete, so it is the time a client has to send its headers (and the idle time of a keep-alive connection);
  guard.read_body gives the body the same time.
- aiohttp has no connection limit: a connection accepted beyond `max_connections` is closed at once, so the
  process keeps file descriptors for calls however many connections a client opens.
- asyncio gives a TLS handshake 60 s (ssl_handshake_timeout's default); a half-open handshake holds only a socket.
- A request aiohttp cannot parse (a control byte in a header, a line over MAX_HEADER_LINE) gets the contract's
  JSON 400 `bad_request`, logged as one line without its traceback or its bytes (they may hold a token): the
  client's fault, not the server's. aiohttp answers it before any handler or middleware runs. A body it cannot
  read (a bad gzip, a broken multipart part) is the handlers' 400 `bad_request`, and no traceback either.
- A flood must not flood the log: each message (logger and format) is written at most LOG_BURST times per
  LOG_WINDOW_S, then the next one says how many were dropped.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from .errors import UNREADABLE_BODY, ApiError

log = logging.getLogger(__name__)
LOG_BURST = 20
LOG_WINDOW_S = 10.0
MAX_HEADER_LINE = 8190  # aiohttp's defaults, named here because they are part of the limits
MAX_HEADERS = 128


class Runner(web.AppRunner):
    """aiohttp's AppRunner with the timeouts, header limits and connection cap of `limits`."""

    def __init__(self, app: web.Application, *, request_timeout_s: float, max_connections: int,
                 on_refused: Callable[[], None] = lambda: None, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=request_timeout_s, max_line_size=MAX_HEADER_LINE,
                         max_field_size=MAX_HEADER_LINE, max_headers=MAX_HEADERS, **kwargs)
        self._max_connections = max_connections
        self._on_refused = on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # (aiohttp's own, but for the connection handler it makes: see _Server)
        register = server.connection_made
        limit, refused = self._max_connections, self._on_refused
        loop = asyncio.get_running_loop()

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            register(handler, transport)  # registered either way: aiohttp's connection_lost cleans up
            if len(server.connections) > limit:
                refused()
                log.warning("%d connections open: a new one was closed", limit)
                loop.call_soon(transport.abort)  # once the handler has started (it expects that order)

        server.connection_made = connection_made  # type: ignore[method-assign]  (the Server's per-connection hook)
        return server


class _ClientErrors(RequestHandler):
    """aiohttp's connection handler, but a request it cannot parse is answered with the contract's JSON error, and
    the rest of a body it cannot read (errors.UNREADABLE_BODY: the handler has answered 400) is dropped without a
    traceback."""

    __slots__ = ()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        if isinstance(kw.get("exc_info"), UNREADABLE_BODY):
            log.debug("dropped the rest of a request body that cannot be read")
            return
        super().log_exception(*args, **kw)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:  # a bug (logged with its traceback), or too late
            return super().handle_error(request, status, exc, message)
        what = re.split(r"[:'\"\n]", message or "", maxsplit=1)[0].strip()[:200] or "malformed"  # (not its bytes)
        log.info("refused a request from %s that is not valid HTTP (%d: %s)", request.remote, status, what)
        response = ApiError(status, "bad_request", f"the request is not valid HTTP: {what}").response()
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's Server, making _ClientErrors connection handlers (it has no setting for their class)."""

    def __call__(self) -> RequestHandler:
        return _ClientErrors(self, loop=self._loop, **self._kwargs)


class RateLimit(logging.Filter):
    """Lets each (logger, message format) through LOG_BURST times per LOG_WINDOW_S."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._seen: dict[tuple[str, str], list[float | int]] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window_s:
            dropped = int(entry[2]) if entry else 0
            if len(self._seen) > 10_000:  # bounded: forget old keys
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this were not logged]"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


def rate_limit_logging() -> None:
    """Puts a RateLimit on every handler of the root logger (once)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RateLimit) for f in handler.filters):
            handler.addFilter(RateLimit())
