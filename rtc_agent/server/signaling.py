"""HTTP side of a call: POST /api/offer answers a WebRTC offer, DELETE /api/sessions/{id} hangs up."""
from __future__ import annotations

import functools
import logging

from aiohttp import web
from aiortc import RTCPeerConnection, RTCSessionDescription

from ..media.ice import rtc_configuration
from ..media.inbound import use_low_latency_audio
from ..media.outbound import PACKET_S
from ..media.vad import SpeechProbability
from . import json_input
from .errors import ApiError, ProtocolError
from .guard import read_body
from .protocol import Offer, parse_offer
from .sessions import CallSession, Full
from .state import STATE, ServerState

log = logging.getLogger(__name__)
RETRY_AFTER_FULL_S = 10
RETRY_AFTER_LOADING_S = 5


async def offer(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        return await _offer(request, state)
    except ApiError as exc:
        if exc.status in (400, 408, 413, 415):
            state.metrics.rejected.labels("bad_request").inc()
        raise


async def _offer(request: web.Request, state: ServerState) -> web.Response:
    body = await read_body(request, ("application/json",))
    try:
        parsed = parse_offer(json_input.loads(body))
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
    from ..engine import EngineFullError, SessionOptions

    settings = state.settings
    voice = offer.voice or settings.voice
    instructions = offer.instructions if offer.instructions is not None else settings.instructions
    try:
        options = SessionOptions(voice=voice, instructions=instructions,
                                 max_frames=max(1, round(settings.max_answer_s / PACKET_S)))
        engine_session = state.engine.new_session(options)
    except ValueError as exc:
        raise ApiError(400, "invalid_value", str(exc)) from None
    except EngineFullError as exc:
        state.metrics.rejected.labels("full").inc()
        raise ApiError(503, "server_full", str(exc), {"Retry-After": str(RETRY_AFTER_FULL_S)}) from None
    vad = await state.vads.acquire()
    pc = RTCPeerConnection(rtc_configuration(settings.ice_servers))
    call = CallSession(settings, pc, engine_session, vad, state.metrics, state.engine.describe(), voice,
                       instructions, on_closed=functools.partial(_call_ended, state, vad))
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer.sdp, type="offer"))
        pc.addTrack(call.track)
        use_low_latency_audio(pc)
        await pc.setLocalDescription(await pc.createAnswer())
    except BaseException as exc:
        await call.close("offer failed")
        if isinstance(exc, Exception):  # sdp_offer let through something aiortc cannot use
            log.warning("aiortc refused a checked offer: %r", exc)
            raise ApiError(400, "invalid_sdp", f"the offer cannot be used: {str(exc)[:200]}") from None
        raise
    return call


def _call_ended(state: ServerState, vad: SpeechProbability, call: CallSession) -> None:
    state.sessions.remove(call)
    state.vads.release(vad)


async def hang_up(request: web.Request) -> web.Response:
    state = request.app[STATE]
    call = state.sessions.get(request.match_info["session_id"])
    if call is None:
        raise ApiError(404, "session_not_found", "no call with this id")
    await call.close("hung up")
    return web.json_response({"session_id": call.id, "status": "closed"})
