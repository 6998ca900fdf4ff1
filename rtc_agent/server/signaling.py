"""HTTP side of a call: POST /api/offer answers a WebRTC offer, DELETE /api/sessions/{id} hangs up."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiortc import RTCPeerConnection, RTCSessionDescription

from ..media.ice import rtc_configuration
from ..media.inbound import use_low_latency_audio
from ..media.outbound import PACKET_S
from ..media.end_of_turn import installed_scorer
from ..media.vad import SpeechProbability
from .protocol import Offer, ProtocolError, parse_offer
from .sessions import CallSession, Full
from .state import STATE, ServerState

log = logging.getLogger(__name__)
RETRY_AFTER_FULL_S = 10
RETRY_AFTER_LOADING_S = 5


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}

    def response(self) -> web.Response:
        body = {"error": {"code": self.code, "message": self.message}}
        return web.json_response(body, status=self.status, headers=self.headers)


@web.middleware
async def api_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
    """Token check, and JSON errors for everything under /api/."""
    if not request.path.startswith("/api/"):
        return await handler(request)
    try:
        _check_token(request)
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        return ApiError(413, "body_too_large", "the request body is too large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason).response()


def _check_token(request: web.Request) -> None:
    token = request.app[STATE].settings.token
    if not token or request.method == "OPTIONS":
        return
    header = request.headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise ApiError(401, "unauthorized", "this server needs 'Authorization: Bearer <token>'",
                       {"WWW-Authenticate": "Bearer"})


async def _json_body(request: web.Request) -> Any:
    limit = request.app[STATE].settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "body_too_large", f"the body may be at most {limit} bytes")
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError(400, "invalid_json", "the body is not JSON") from None


async def offer(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        return await _offer(request, state)
    except ApiError as exc:
        if exc.status in (400, 413):
            state.metrics.rejected.labels("bad_request").inc()
        raise


async def _offer(request: web.Request, state: ServerState) -> web.Response:
    try:
        parsed = parse_offer(await _json_body(request))
    except ProtocolError as exc:
        raise ApiError(400, exc.code, exc.message) from None
    if not state.ready:
        state.metrics.rejected.labels("loading").inc()
        raise ApiError(503, "not_ready", "the model is still loading", {"Retry-After": str(RETRY_AFTER_LOADING_S)})
    try:
        state.sessions.reserve()
    except Full:
        state.metrics.rejected.labels("full").inc()
        raise ApiError(503, "server_full", f"all {state.sessions.max_sessions} call slots are taken",
                       {"Retry-After": str(RETRY_AFTER_FULL_S)}) from None
    try:
        call = await _start_call(state, parsed)
    finally:
        state.sessions.release()
    state.sessions.add(call)
    log.info("call %s started (%d active)", call.id, len(state.sessions))
    local = call.pc.localDescription
    return web.json_response({"sdp": local.sdp, "type": local.type, "session_id": call.id})


async def _start_call(state: ServerState, offer: Offer) -> CallSession:
    from ..engine import SessionOptions

    settings = state.settings
    voice = offer.voice or settings.voice
    instructions = offer.instructions if offer.instructions is not None else settings.instructions
    try:
        options = SessionOptions(voice=voice, instructions=instructions,
                                 max_frames=max(1, round(settings.max_answer_s / PACKET_S)))
        engine_session = state.engine.new_session(options)
    except ValueError as exc:
        raise ApiError(400, "invalid_value", str(exc)) from None
    vad = await asyncio.to_thread(SpeechProbability)
    end_of_turn = await asyncio.to_thread(installed_scorer)
    pc = RTCPeerConnection(rtc_configuration(settings.ice_servers))
    call = CallSession(settings, pc, engine_session, vad, state.metrics, state.engine.describe(), voice,
                       instructions, on_closed=state.sessions.remove, end_of_turn=end_of_turn)
    try:
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer.sdp, type="offer"))
        except Exception as exc:  # aiortc raises ValueError and friends on SDP it cannot use
            raise ApiError(400, "invalid_sdp", f"the offer cannot be used: {exc}") from None
        if not any(t.kind == "audio" for t in pc.getTransceivers()):
            raise ApiError(400, "no_audio", "the offer has no audio: the call needs a microphone track")
        pc.addTrack(call.track)
        use_low_latency_audio(pc)
        await pc.setLocalDescription(await pc.createAnswer())
    except BaseException:
        await call.close("offer failed")
        raise
    return call


async def hang_up(request: web.Request) -> web.Response:
    state = request.app[STATE]
    call = state.sessions.get(request.match_info["session_id"])
    if call is None:
        raise ApiError(404, "session_not_found", "no call with this id")
    await call.close("hung up")
    return web.json_response({"session_id": call.id, "status": "closed"})
