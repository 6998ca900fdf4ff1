"""The front of the process split: the public HTTP port, in a process that runs no call.

Every request goes on, unchanged, to a media process (processes.py) over its Unix socket; the call's media never
pass through here. Which one: a request that names a call (its id in the path, a resume token in the offer, a
client secret as its bearer) goes to the process whose mark ("m2.") the name carries, except a resume offer for
a process that is not ready (it died: another takes the call over from the engine); a new call goes to the
ready process with the fewest calls; anything else to the next ready one. An offer whose process does not answer
is tried once more on another ready one; an offer made again (the same ICE credentials) goes where the first went,
which refuses it while a call holds it (409 `duplicate_offer`), as one process does. Under /api/ the front first
runs the guard a media process runs (guard.py: Origin, then the bearer token, then an offer's media type, size and
read time) and reads an offer as a media process does (strict JSON, the SDP checked): both layouts refuse bad
input alike, and nothing a caller without the token sends there is read. The front answers the probes itself
from what the media processes and the engine report (/healthz, /readyz, /capacity) and merges every process's
/metrics into one page, each series labelled with its `process`. A Realtime WebSocket is relayed frame by frame.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, generate_latest

from ..config import Settings
from ..engine.ipc.remote import RemoteEngine
from ..loop_lag import watched_process
from .errors import UNREADABLE_BODY, ApiError, unreadable_body
from .guard import bearer, read_body
from .protocol import Offer
from .realtime import MAX_EVENT_BYTES
from .signaling import read_offer

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often each media process's /readyz is read
NEW_CALLS = {("POST", "/api/offer"), ("POST", "/v1/realtime/calls"), ("GET", "/v1/realtime")}
MARK = re.compile(r"(?:sess_|ek_)?(m\d+)\.")
CALL_PATH = re.compile(r"^/(?:api/sessions|v1/realtime/calls)/([^/]+)")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "content-length", "te", "trailer",
              "proxy-authorization", "proxy-authenticate", "content-encoding"}
RETRY_AFTER_S = "5"
REMEMBERED_OFFERS = 4096  # the ICE credentials of the latest new-call offers, with the process each went to


@dataclass
class MediaProcess:
    """What the front knows of one media process: its socket and its latest /readyz."""

    mark: str  # "m0"
    socket: Path
    pid: int | None = None
    ready: bool = False
    calls: int = 0  # sessions, as its latest /readyz said
    # New calls sent to it that `calls` may not count yet: those whose answer has not come back, and those answered
    # after its latest /readyz was asked (two offers a few ms apart each went to the same process when a /readyz
    # asked before the first one's answer came back after it and cleared the count)
    in_flight: int = 0
    answered: int = 0  # new calls it has answered
    counted: int = 0  # `answered` when its latest /readyz was asked
    http: aiohttp.ClientSession | None = field(default=None, repr=False)

    @property
    def load(self) -> int:
        return self.calls + self.in_flight + self.answered - self.counted

    def settle(self) -> None:
        """A new call sent here was answered (or refused)."""
        self.in_flight -= 1
        self.answered += 1

    def client(self) -> aiohttp.ClientSession:
        if self.http is None or self.http.closed:
            self.http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.socket)),
                                              auto_decompress=False)
        return self.http


class Front:
    def __init__(self, settings: Settings, media: list[MediaProcess], engine: RemoteEngine,
                 engine_pid: int | None) -> None:
        self.settings = settings
        self.media = media
        self.engine = engine
        self.registry = CollectorRegistry()  # the front's own page: its CPU, loop, collections, refused connections
        self.loop_lag, self.gc_pauses = watched_process(self.registry)
        self.connections_refused = Counter("rtc_agent_connections_refused", "HTTP connections closed at once: "
                                           "max_connections were open", registry=self.registry)
        self.engine_pid = engine_pid
        self.draining = False
        self._turn = itertools.cycle(range(len(media)))
        self._offered: OrderedDict[str, MediaProcess] = OrderedDict()

    # ---- choosing a media process -----------------------------------------------------------------------------
    def owner(self, request: web.Request, resume_token: str) -> MediaProcess | None:
        """The process a request belongs to, when it names a call or a client secret of one."""
        names = [bearer(request.headers.get("Authorization", "")), resume_token]
        if (match := CALL_PATH.match(request.path)) is not None:
            names.append(match.group(1))
        for name in names:
            if (mark := MARK.match(name)) is not None:
                for process in self.media:
                    if process.mark == mark.group(1):
                        return process
        return None

    def least_loaded(self, ice: str = "") -> MediaProcess:
        """The ready process with the fewest calls, or, for an offer of ICE credentials `ice` made before, the
        one it went to (there it is known); the caller `settle`s it once its answer is back."""
        ready = [p for p in self.media if p.ready]
        if not ready:
            raise ApiError(503, "not_ready", "no media process is ready", {"Retry-After": RETRY_AFTER_S})
        before = self._offered.pop(ice, None)
        process = before if before in ready else min(ready, key=lambda p: p.load)
        if ice:
            self._offered[ice] = process
            if len(self._offered) > REMEMBERED_OFFERS:
                self._offered.popitem(last=False)
        process.in_flight += 1
        return process

    def any_ready(self) -> MediaProcess:
        for _ in self.media:
            process = self.media[next(self._turn)]
            if process.ready:
                return process
        return self.media[0]

    def route(self, request: web.Request, offer: Offer | None = None) -> tuple[MediaProcess, bool]:
        """The process for a request (`offer`: its body, if it is an offer), and whether it is a new call sent by
        load (to `settle` once answered)."""
        process = self.owner(request, offer.resume_token or "" if offer is not None else "")
        if process is not None and (process.ready or self.draining or request.path != "/api/offer"):
            return process, False
        # (a resume offer whose process died, or is starting again: any ready one takes the call over)
        if (request.method, request.path) in NEW_CALLS:
            if self.engine.lost is not None:
                raise ApiError(503, "engine_unavailable", self.engine.lost, {"Retry-After": RETRY_AFTER_S})
            if self.draining:
                raise ApiError(503, "draining", "this server is shutting down and takes no new calls",
                               {"Retry-After": RETRY_AFTER_S})
            return self.least_loaded(offer.ice if offer is not None else ""), True
        return self.any_ready(), False

    # ---- the media processes' state ------------------------------------------------------------------------
    async def watch(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(p) for p in self.media))
            await asyncio.sleep(POLL_S)

    async def _poll(self, process: MediaProcess) -> None:
        answered = process.answered
        try:
            async with process.client().get("http://media/readyz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                body = await r.json()
            process.ready = r.status == 200
            process.calls = int(body.get("sessions", 0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            process.ready, process.calls = False, 0
        process.counted = answered

    def forget(self, process: MediaProcess) -> None:
        """A media process died: nothing goes to it until it is back and ready."""
        process.ready, process.calls, process.counted = False, 0, process.answered

    # ---- handlers ---------------------------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            if request.headers.get("Upgrade", "").lower() == "websocket":
                return await self._relay_websocket(request, *self.route(request))
            offer: Offer | None = None
            if (request.method, request.path) == ("POST", "/api/offer"):  # (api_guard has checked the caller)
                body = await read_body(request, ("application/json",))
                offer = read_offer(body)
            else:
                body = await asyncio.wait_for(request.read(), self.settings.request_timeout_s)
            process, new = self.route(request, offer)
        except ApiError as exc:
            return exc.response()
        except asyncio.TimeoutError:
            return ApiError(408, "request_timeout", "the body did not arrive in time").response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(413, "body_too_large", "the request body is too large").response()
        except UNREADABLE_BODY:
            return unreadable_body().response()
        for tries_left in (1, 0):
            try:
                return await self._forward(process, request, body)
            except aiohttp.ClientError as exc:
                log.warning("media process %s did not answer %s %s: %r", process.mark, request.method, request.path,
                            exc)
                self.forget(process)
            finally:
                if new:
                    process.settle()
            if not tries_left or (request.method, request.path) not in NEW_CALLS:
                break
            try:  # an offer (a new call, or a resume: the engine kept the call) goes to another ready process
                process, new = self.route(request, offer)
            except ApiError as exc:
                return exc.response()
        return ApiError(502, "media_process_unavailable", "the process that holds this call is not answering; "
                        "start a new call", {"Retry-After": RETRY_AFTER_S}).response()

    @staticmethod
    async def _forward(process: MediaProcess, request: web.Request, body: bytes) -> web.Response:
        async with process.client().request(request.method, f"http://media{request.path_qs}",
                                            headers=_forwarded(request.headers), data=body,
                                            allow_redirects=False) as r:
            payload = await r.read()
            headers = CIMultiDict((k, v) for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP)
            return web.Response(status=r.status, body=payload, headers=headers)

    async def _relay_websocket(self, request: web.Request, process: MediaProcess, new: bool) -> web.StreamResponse:
        """A Realtime WebSocket: the client's frames to the media process and back, until either side closes.
        If the media process dies, the client gets an `error` event, then the close."""
        client = web.WebSocketResponse(protocols=("realtime",), heartbeat=20.0, max_msg_size=MAX_EVENT_BYTES)
        try:
            if not client.can_prepare(request).ok:  # (no Sec-WebSocket-Key, a wrong version: nothing to relay)
                return ApiError(400, "bad_request", "the request is not a WebSocket handshake").response()
            upstream = await process.client().ws_connect(
                f"http://media{request.path_qs}", headers=_forwarded(request.headers, websocket=True),
                protocols=("realtime",), max_msg_size=0, autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            return ApiError(exc.status, "refused", f"the call was refused ({exc.status} {exc.message})").response()
        except aiohttp.ClientError:
            self.forget(process)
            return ApiError(503, "media_process_unavailable", "no media process took the call",
                            {"Retry-After": RETRY_AFTER_S}).response()
        finally:
            if new:
                process.settle()
        await client.prepare(request)

        async def to_client() -> None:
            await _pump(upstream, client)
            if not client.closed and upstream.close_code not in (1000, 1001):  # not a clean close: it died
                await client.send_json({"type": "error", "error": {
                    "type": "server_error", "code": "session_failed",
                    "message": "the process that held this session failed; open a new one"}})

        tasks = [asyncio.create_task(_pump(client, upstream)), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await upstream.close()
            await client.close()
        return client

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _counts(self) -> dict[str, int]:
        """Calls and slots as the engine has them now (its slots are the server's)."""
        if self.engine.ready:
            try:
                await self.engine.refresh()
            except Exception:  # gone since: `lost` says so
                pass
        describe = self.engine.describe()
        return {"active": int(describe.get("max_sessions", 0)) - int(describe.get("free_sessions", 0)),
                "free": int(describe.get("free_sessions", 0)), "max_sessions": int(describe.get("max_sessions", 0))}

    def _processes(self) -> dict[str, Any]:
        return {"engine_pid": self.engine_pid, "media_processes_ready": sum(p.ready for p in self.media),
                "media_processes": [{"mark": p.mark, "pid": p.pid, "ready": p.ready, "calls": p.calls}
                                    for p in self.media]}

    async def readyz(self, request: web.Request) -> web.Response:
        counts = await self._counts()
        if self.engine.lost is not None:
            return web.json_response({"status": "failed", "error": self.engine.lost, **self._processes()},
                                     status=503)
        if self.engine.ready and any(p.ready for p in self.media):
            return web.json_response({"status": "ready", "engine": self.engine.describe(), **counts,
                                      **self._processes()})
        return web.json_response({"status": "loading", **counts, **self._processes()}, status=503)

    async def capacity(self, request: web.Request) -> web.Response:
        """As one process's /capacity: 200 available, 404 full or draining, 503 not loaded (or the engine gone)."""
        counts = await self._counts()
        if self.engine.lost is not None or not self.engine.ready or not any(p.ready for p in self.media):
            status = "failed" if self.engine.lost else "loading"
            return web.json_response({"status": status, **counts}, status=503)
        if self.draining:
            return web.json_response({"status": "draining", **counts}, status=404)
        if counts["free"] <= 0:
            return web.json_response({"status": "full", "reason": "slots", **counts}, status=404)
        return web.json_response({"status": "available", **counts})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """Every process's metrics on one page: the front's, the engine's (process CPU and memory), each media
        process's, their series labelled `process`."""
        scraped = await asyncio.gather(self._engine_page(), *(self._scrape(p) for p in self.media))
        pages = [("front", generate_latest(self.registry).decode()), ("engine", scraped[0]),
                 *zip((p.mark for p in self.media), scraped[1:])]
        return web.Response(text=merge_metrics(pages), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _engine_page(self) -> str:
        try:
            return await asyncio.wait_for(self.engine.metrics_page(), 2) if self.engine.ready else ""
        except Exception:  # (gone, or slow: the page goes without it)
            return ""

    async def _scrape(self, process: MediaProcess) -> str:
        if not process.ready:
            return ""
        try:
            async with process.client().get("http://media/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return ""

    async def close(self) -> None:
        for process in self.media:
            if process.http is not None:
                await process.http.close()


async def _pump(source: Any, sink: Any) -> None:
    """One direction of a relayed WebSocket: every text and binary frame of `source` to `sink`, until it closes."""
    async for msg in source:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(msg.data)


def _forwarded(headers: Any, websocket: bool = False) -> CIMultiDict[str]:
    skip = HOP_BY_HOP | ({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                          "sec-websocket-protocol"} if websocket else set())
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in skip)


def merge_metrics(pages: list[tuple[str, str]]) -> str:
    """Prometheus text pages of several processes as one: each series gets a `process` label, each family one
    header. Line by line, not through prometheus_client's parser: that took 6 ms for five media processes' pages
    on the 2-core CPU, more on the GPU machine's slower cores, on the front's event loop at every scrape."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name: (its # HELP and # TYPE lines, its samples)
    for process, text in pages:
        label = f'process="{_escape(process)}"'
        samples: list[str] = []
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    header, samples = families.setdefault(parts[2], ([], []))
                    if all(h.split(" ", 2)[1] != parts[1] for h in header):
                        header.append(line)
            elif line and (labelled := _with_process(line, label)) is not None:
                samples.append(labelled)
    return "\n".join(line for header, samples in families.values() for line in (*header, *samples)) + "\n"


def _with_process(sample: str, label: str) -> str | None:
    """A sample line with `label` (`process="..."`) first among its labels (None: a `_created` timestamp, left
    out)."""
    brace, space = sample.find("{"), sample.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        name, rest = sample[:brace], sample[brace + 1:]
        labelled = f"{name}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    else:
        name, rest = sample[:space], sample[space:]
        labelled = f"{name}{{{label}}}{rest}"
    return None if name.endswith("_created") else labelled


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
