"""The Realtime API's HTTP side under /v1/realtime: WebRTC calls, the WebSocket, ephemeral client secrets, CORS.

- `POST /v1/realtime/calls`: the SDP offer as `application/sdp`, or a multipart form with `sdp` and an optional
  `session` (JSON); 201 with the SDP answer and `Location: /v1/realtime/calls/{call_id}`.
- `POST /v1/realtime/calls/{call_id}/hangup`: ends the call.
- `GET /v1/realtime?model=...`: the WebSocket (realtime_ws.py).
- `POST /v1/realtime/client_secrets`: an ephemeral key `ek_...` that a browser may use as its bearer until it
  expires, so it never holds the server token; minting one needs the server token itself.

Errors are the OpenAI shape, `{"error": {"message", "type", "code", "param"}}`. Cross-origin pages (an SDK page
served elsewhere) get their CORS preflight answered: any origin may call, since the bearer (never a cookie) is
what authorizes a request.
"""
from __future__ import annotations

import functools
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..engine.step.tools import ToolSet
from ..media.captions import Transcription
from .errors import UNREADABLE_BODY, unreadable_body
from .guard import bearer
from .protocol import ProtocolError, SessionUpdate, parse_offer
from .realtime import MAX_EVENT_BYTES, RealtimeError, parse_json, parse_session, session_object
from .realtime_ws import RealtimeSocket
from .signaling import ApiError, answering, call_ended, check_capacity, new_engine_session, open_call
from .state import STATE

log = logging.getLogger(__name__)
PREFIX = "/v1/realtime"
SECRET_TTL_S = (10, 7200, 600)  # least, most, default seconds (as the Realtime API's expires_after)
MAX_SECRETS = 10_000
INSECURE_KEY_PROTOCOL = "openai-insecure-api-key."  # how a browser WebSocket carries its key


@dataclass(frozen=True)
class ClientSecret:
    expires_at: int  # unix time
    session: SessionUpdate | None  # the session settings it was minted with


class ClientSecrets:
    """Ephemeral keys in memory: usable, for any number of calls, until they expire."""

    def __init__(self, clock: Callable[[], float] = time.time, tag: str = "") -> None:
        self._secrets: dict[str, ClientSecret] = {}
        self._clock = clock
        self.tag = tag  # the media process's mark: the front sends calls that use the key to the process that knows it

    def mint(self, ttl_s: int, session: SessionUpdate | None) -> tuple[str, ClientSecret]:
        now = self._clock()
        self._secrets = {k: v for k, v in self._secrets.items() if v.expires_at > now}
        if len(self._secrets) >= MAX_SECRETS:
            raise RealtimeError("rate_limit_exceeded", f"{MAX_SECRETS} client secrets are live; wait for some to "
                                "expire")
        value = f"ek_{self.tag}{secrets.token_urlsafe(24)}"
        secret = self._secrets[value] = ClientSecret(int(now) + ttl_s, session)
        return value, secret

    def get(self, value: str) -> ClientSecret | None:
        secret = self._secrets.get(value)
        if secret is None or secret.expires_at <= self._clock():
            self._secrets.pop(value, None)
            return None
        return secret


SECRETS = web.AppKey("rtc_agent_client_secrets", ClientSecrets)


def add_realtime_routes(app: web.Application) -> None:
    app[SECRETS] = ClientSecrets(tag=app[STATE].tag)
    app.router.add_get(PREFIX, websocket)
    app.router.add_post(PREFIX + "/calls", create_call)
    app.router.add_post(PREFIX + "/calls/{call_id}/hangup", hang_up)
    app.router.add_post(PREFIX + "/client_secrets", create_client_secret)
    app.router.add_route("*", "/v1/{rest:.*}", not_found)


def _error(status: int, code: str, message: str, param: str | None = None,
           headers: dict[str, str] | None = None, reason: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": code, "param": param,
                      **({"reason": reason} if reason else {})}}
    return web.json_response(body, status=status, headers=headers)


def _cors(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Access-Control-Allow-Origin"] = "*"
    response.headers["Access-Control-Expose-Headers"] = "Location"


@web.middleware
async def realtime_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                              ) -> web.StreamResponse:
    """CORS and OpenAI-shaped errors for everything under /v1/."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    if request.method == "OPTIONS":
        asked = request.headers.get("Access-Control-Request-Headers", "")[:512]
        response: web.StreamResponse = web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
            "Access-Control-Max-Age": "600"})
    else:
        try:
            response = await handler(request)
        except ApiError as exc:
            response = _error(exc.status, exc.code, exc.message, headers=exc.headers, reason=exc.reason)
        except RealtimeError as exc:
            response = _error(400, exc.code, exc.message, exc.param)
        except ProtocolError as exc:
            response = _error(400, exc.code, exc.message, exc.param)
        except web.HTTPRequestEntityTooLarge:
            response = _error(413, "body_too_large", "the request body is too large")
        except UNREADABLE_BODY:
            response = _error(400, "bad_request", unreadable_body().message)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
    if not response.prepared:  # (a WebSocket has already sent its headers)
        _cors(request, response)
    return response


def _bearer(request: web.Request) -> str:
    if given := bearer(request.headers.get("Authorization", "")):
        return given
    for protocol in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        if protocol.strip().startswith(INSECURE_KEY_PROTOCOL):
            return protocol.strip()[len(INSECURE_KEY_PROTOCOL):]
    return ""


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "invalid_api_key", message, {"WWW-Authenticate": "Bearer"})


def authorize(request: web.Request, ephemeral: bool = True) -> SessionUpdate | None:
    """Checks the bearer: the server token, or (where `ephemeral`) a live client secret, whose session settings
    are returned. A server without a token takes any caller, but an `ek_` key must still be live."""
    given = _bearer(request)
    if ephemeral and given.startswith("ek_"):
        secret = request.app[SECRETS].get(given)
        if secret is None:
            raise _unauthorized("this client secret is unknown or has expired")
        return secret.session
    token = request.app[STATE].settings.token
    if token and not hmac.compare_digest(given.encode(), token.encode()):
        raise _unauthorized("this server needs 'Authorization: Bearer <token or client secret>'")
    return None


# ---- handlers ---------------------------------------------------------------------------------------------
async def create_client_secret(request: web.Request) -> web.Response:
    authorize(request, ephemeral=False)
    state = request.app[STATE]
    raw = await request.read()
    body = _json(raw) if raw else {}
    if not isinstance(body, dict):
        raise RealtimeError("invalid_value", "the body must be a JSON object")
    least, most, ttl = SECRET_TTL_S
    expires = body.get("expires_after") or {}
    if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at":
        raise RealtimeError("invalid_value", 'expires_after is {"anchor": "created_at", "seconds": N}',
                            "expires_after")
    ttl = expires.get("seconds", ttl)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not least <= ttl <= most:
        raise RealtimeError("invalid_value", f"expires_after.seconds must be {least} to {most}",
                            "expires_after.seconds")
    update = parse_session(body["session"], state.settings.turn) if body.get("session") is not None else None
    tools = (update and update.tool_set(ToolSet())) or ToolSet()  # (checked whole here: a call cannot refuse it)
    value, secret = request.app[SECRETS].mint(ttl, update)
    s = state.settings
    model = state.engine.describe().get("model") if state.ready else s.model
    session = session_object(f"sess_{state.tag}{secrets.token_urlsafe(9)}", model, (update and update.voice) or s.voice,
                             update.instructions if update and update.instructions is not None else s.instructions,
                             (update and update.turn) or s.turn,
                             update.text_only if update and update.text_only is not None else s.no_talker, tools,
                             language=(update.language if update and update.language is not None else s.language)
                             or None,
                             transcription=update.transcription
                             if update and isinstance(update.transcription, Transcription) else None)
    return web.json_response({"value": value, "expires_at": secret.expires_at, "session": session})


async def create_call(request: web.Request) -> web.Response:
    state = request.app[STATE]
    update = authorize(request)
    sdp, session = await _call_body(request)
    offer = parse_offer({"type": "offer", "sdp": sdp})
    extra = parse_session(session, state.settings.turn) if session is not None else None
    with answering(state, offer):
        call = await open_call(state, offer, realtime=True)
    try:
        for u in (update, extra):  # the client secret's settings, then the call's own
            if u is not None:
                call.realtime.apply(u)
    except ProtocolError:
        await call.close("bad session settings")
        raise
    return web.Response(status=201, text=call.pc.localDescription.sdp, content_type="application/sdp",
                        headers={"Location": f"{PREFIX}/calls/{call.id}"})


async def _call_body(request: web.Request) -> tuple[str, Any]:
    """(sdp, session JSON or None) from an application/sdp body or a multipart form."""
    if request.content_type == "application/sdp":
        return _form_text(await request.read()), None
    if request.content_type != "multipart/form-data":
        raise ApiError(415, "unsupported_media_type", "send the offer as application/sdp or multipart/form-data")
    form = await request.post()
    sdp, session = _form_text(form.get("sdp")), _form_text(form.get("session"))
    if sdp is None:
        raise RealtimeError("missing_required_parameter", "the form needs an sdp part", "sdp")
    if session is None:
        return sdp, None
    return sdp, parse_json(session, "the session part is not JSON", "session")


def _form_text(value: Any) -> str | None:
    """A form part (or an application/sdp body) as text: aiohttp gives str (text/*), bytes or bytearray (other
    types, as the SDK's application/sdp) or a FileField (a part with a file name)."""
    if hasattr(value, "file"):
        value = value.file.read()
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            raise RealtimeError("invalid_value", "the SDP and form parts must be UTF-8 text") from None
    return value


async def hang_up(request: web.Request) -> web.Response:
    authorize(request)
    call = request.app[STATE].sessions.get(request.match_info["call_id"])
    if call is None:
        raise ApiError(404, "call_not_found", "no call with this id")
    await call.close("hung up")
    return web.Response(status=200)


async def websocket(request: web.Request) -> web.StreamResponse:
    update = authorize(request)
    state = request.app[STATE]
    s = state.settings
    check_capacity(state)
    try:
        engine_session = await new_engine_session(state, s.voice, s.instructions, s.language)
        vad = await state.vads.acquire()
        try:
            end_of_turn = state.end_of_turn
            ws = web.WebSocketResponse(protocols=("realtime",), heartbeat=20.0, max_msg_size=MAX_EVENT_BYTES)
            await ws.prepare(request)
        except BaseException:  # (the client went away during the upgrade)
            state.vads.release(vad)
            await engine_session.close()
            raise
        describe = state.engine.describe()
        socket = RealtimeSocket(ws, s, engine_session, vad, state.metrics, describe.get("model"), s.voice,
                                s.instructions, on_closed=functools.partial(call_ended, state, vad),
                                end_of_turn=end_of_turn, speech=bool(describe.get("speech", True)),
                                tag=state.tag, captions=state.captions)
        if update is not None:  # checked when the secret was minted
            socket.realtime.apply(update)
    finally:
        state.sessions.release()
    state.sessions.add(socket)
    log.info("websocket %s started (%d active)", socket.id, len(state.sessions))
    await socket.run()
    return ws


async def not_found(request: web.Request) -> web.Response:
    raise ApiError(404, "not_found", f"no API at {request.method} {request.path}")


def _json(raw: bytes) -> Any:
    return parse_json(raw, "the body is not JSON")
