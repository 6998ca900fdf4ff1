"""HTTP side of a call: POST /api/offer answers a WebRTC offer (or resumes a call), GET /api/sessions/{id} says
whether it is here, DELETE /api/sessions/{id} hangs up."""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

from aiohttp import web
from aiortc import RTCPeerConnection, RTCSessionDescription

from ..config import Settings
from ..engine.ipc.session_protocol import EngineSession
from ..engine.ipc.remote import RemoteEngine, RemoteSession
from ..media.captions import Transcription
from ..media.ice import rtc_configuration
from ..media.inbound import use_low_latency_audio
from ..media.moonshine import LANGUAGES, NAME, installed
from ..media.outbound import PACKET_S, OutboundAudioTrack
from ..media.vad import SpeechProbability
from . import json_input
from .errors import ApiError, ProtocolError
from .guard import read_body
from .metrics import Metrics
from .protocol import OFF, Offer, parse_offer
from .sessions import CallSession, Duplicate, Full
from .state import STATE, ServerState

log = logging.getLogger(__name__)
RETRY_AFTER_FULL_S = 10
RETRY_AFTER_LOADING_S = 5
RETRY_AFTER_DRAINING_S = 5
RETRY_AFTER_MEMORY_S = 10


async def offer(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        return await _offer(request, state)
    except ApiError as exc:
        if exc.status in (400, 408, 409, 413, 415):
            state.metrics.rejected.labels("bad_request").inc()
        raise


async def _offer(request: web.Request, state: ServerState) -> web.Response:
    parsed = read_offer(await read_body(request, ("application/json",)))
    with answering(state, parsed):
        if parsed.resume_token is not None:
            return await _resume_call(state, parsed)
        call = await open_call(state, parsed)
    return _answer_response(call.pc, call.id)


def read_offer(body: bytes) -> Offer:
    """An offer's body, parsed and checked (400 with the contract's code when it is not an offer)."""
    try:
        return parse_offer(json_input.loads(body))
    except ProtocolError as exc:
        raise ApiError(400, exc.code, exc.message) from None


@contextlib.contextmanager
def answering(state: ServerState, offer: Offer) -> Iterator[None]:
    """While `offer` is answered (Sessions.answering); 409 `duplicate_offer` when the same offer is being answered
    already, or a call's connection is its answer."""
    try:
        with state.sessions.answering(offer.ice):
            yield
    except Duplicate:
        raise ApiError(409, "duplicate_offer", "this offer (its ICE credentials) has already been answered: each "
                       "call, and each resume, needs a new peer connection's offer") from None


def check_capacity(state: ServerState) -> None:
    """503 unless the model is ready, the server is not draining, GPU memory is below the guard and a call slot is
    free; reserves the slot (give it back with release())."""
    if state.engine_lost:
        state.metrics.rejected.labels("engine").inc()
        raise ApiError(503, "engine_unavailable", state.engine_lost, {"Retry-After": str(RETRY_AFTER_LOADING_S)})
    if not state.ready:
        state.metrics.rejected.labels("loading").inc()
        raise ApiError(503, "not_ready", "the model is still loading", {"Retry-After": str(RETRY_AFTER_LOADING_S)})
    if state.draining:
        state.metrics.rejected.labels("draining").inc()
        raise ApiError(503, "draining", "this server is shutting down and takes no new calls",
                       {"Retry-After": str(RETRY_AFTER_DRAINING_S)})
    memory = state.guard.refusal() if state.guard is not None else None
    if memory is not None:
        state.metrics.rejected.labels("memory").inc()
        log.warning("call refused: %s", memory)
        raise ApiError(503, "server_full", memory, {"Retry-After": str(RETRY_AFTER_MEMORY_S)}, reason="memory")
    try:
        state.sessions.reserve()
    except Full:
        state.metrics.rejected.labels("full").inc()
        raise ApiError(503, "server_full", f"all {state.sessions.max_sessions} call slots are taken",
                       {"Retry-After": str(RETRY_AFTER_FULL_S)}, reason="slots") from None


async def open_call(state: ServerState, offer: Offer, realtime: bool = False) -> CallSession:
    """Answers an offer with a new call (ApiError when it cannot be); `realtime`: its events are the Realtime
    API's, on the `oai-events` channel."""
    check_capacity(state)
    try:
        call = await _start_call(state, offer, realtime)
    finally:
        state.sessions.release()
    state.sessions.add(call)
    log.info("call %s started (%d active)", call.id, len(state.sessions))
    return call


def _answer_response(pc: RTCPeerConnection, session_id: str) -> web.Response:
    """The SDP answer; `Location` names the call, so a load balancer can route its hang-up to this replica."""
    local = pc.localDescription
    return web.json_response({"sdp": local.sdp, "type": local.type, "session_id": session_id},
                             headers={"Location": f"/api/sessions/{session_id}"})


async def _resume_call(state: ServerState, offer: Offer) -> web.Response:
    """A caller whose connection died comes back: a new peer connection for the same call and conversation (here,
    or, if the media process that had the call died, from the engine session it left waiting)."""
    call = state.sessions.by_resume_token(offer.resume_token or "")
    if call is None:
        call = await _adopt_call(state, offer)
        if call is None:
            raise ApiError(404, "session_not_found", "no call to resume with this token (it ended, or the window "
                           "passed)")
        return _answer_response(call.pc, call.id)
    pc = RTCPeerConnection(rtc_configuration(state.settings.ice_servers))
    track = OutboundAudioTrack()
    call.resume(pc, track, offer.ice)  # before the offer is applied: that is when the caller's tracks arrive
    try:
        await _answer_offer(pc, offer.sdp, track, state.metrics)
    except BaseException:
        call.lose("the resume offer failed")  # parked again: the caller may try once more
        raise
    return _answer_response(pc, call.id)


async def new_engine_session(state: ServerState, voice: str, instructions: str, language: str | None
                             ) -> EngineSession:
    from ..engine import EngineFullError, SessionOptions

    try:
        options = SessionOptions(voice=voice, instructions=instructions, language=language,
                                 max_frames=max(1, round(state.settings.max_answer_s / PACKET_S)))
        return await state.engine.open_session(options)
    except ValueError as exc:
        raise ApiError(400, "invalid_value", str(exc)) from None
    except EngineFullError as exc:
        state.metrics.rejected.labels("full").inc()
        raise ApiError(503, "server_full", str(exc), {"Retry-After": str(RETRY_AFTER_FULL_S)}, reason="slots") from None


async def _adopt_call(state: ServerState, offer: Offer) -> CallSession | None:
    """The call of a media process that died, if the engine keeps its session for this resume token: it goes on
    here, under a new id and token of this process (None: no such call)."""
    if not isinstance(state.engine, RemoteEngine):  # one process: no other process's calls to take over
        return None
    try:
        state.sessions.reserve()
    except Full:
        raise ApiError(503, "server_full", f"all {state.sessions.max_sessions} call slots of this process are "
                       "taken", {"Retry-After": str(RETRY_AFTER_FULL_S)}, reason="slots") from None
    try:
        transcription = _transcription(state, offer, False)
        adopted = await state.engine.adopt(offer.resume_token or "")
        if adopted is None:
            return None
        engine_session, was = adopted
        options = engine_session.options
        call = await _new_call(state, offer, engine_session, options.voice, options.instructions, transcription,
                               moved=True)
    finally:
        state.sessions.release()
    state.sessions.add(call)
    log.info("call %s taken over from a media process that died (it was %s; %d active)", call.id, was["id"],
             len(state.sessions))
    return call


async def _start_call(state: ServerState, offer: Offer, realtime: bool) -> CallSession:
    settings = state.settings
    voice = offer.voice or settings.voice
    instructions = offer.instructions if offer.instructions is not None else settings.instructions
    transcription = _transcription(state, offer, realtime)  # (refused before an engine session is opened)
    engine_session = await new_engine_session(state, voice, instructions, offer.language or settings.language)
    return await _new_call(state, offer, engine_session, voice, instructions, transcription, realtime)


async def _new_call(state: ServerState, offer: Offer, engine_session: EngineSession, voice: str, instructions: str,
                    transcription: Transcription | None, realtime: bool = False, moved: bool = False) -> CallSession:
    """A call on `engine_session`, its offer answered. A page's call (not `realtime`: a Realtime client has no use
    for our resume token) on an engine in another process is left waiting there if this process dies, so that
    its caller can resume it in another."""
    settings = state.settings
    vad = await state.vads.acquire()
    end_of_turn = state.end_of_turn
    pc = RTCPeerConnection(rtc_configuration(settings.ice_servers))
    call = CallSession(settings, pc, engine_session, vad, state.metrics, state.engine.describe(), voice,
                       instructions, on_closed=functools.partial(call_ended, state, vad), realtime=realtime,
                       end_of_turn=end_of_turn, tag=state.tag, moved=moved, ice=offer.ice,
                       captions=state.captions, transcription=transcription)
    if isinstance(engine_session, RemoteSession) and not realtime and settings.resume_window_s > 0:
        engine_session.resumable(call.resume_token, settings.resume_window_s, {"id": call.id})
    try:
        await _answer_offer(pc, offer.sdp, call.track, state.metrics)
    except BaseException:
        await call.close("offer failed")
        raise
    return call


async def _answer_offer(pc: RTCPeerConnection, sdp: str, track: OutboundAudioTrack, metrics: Metrics) -> None:
    """Applies an offer that `parse_offer` checked and makes the answer; 400 `invalid_sdp` if aiortc still cannot
    use it."""
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        pc.addTrack(track)
        use_low_latency_audio(pc, metrics.input_audio_packet)
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as exc:  # sdp_offer let through something aiortc cannot use
        log.warning("aiortc refused a checked offer: %r", exc)
        raise ApiError(400, "invalid_sdp", f"the offer cannot be used: {str(exc)[:200]}") from None


def default_transcription(settings: Settings) -> Transcription | None:
    """A page call's captions unless its offer says otherwise: on unless --transcription off or the recogniser
    is not installed (the server loads it before it takes calls)."""
    return Transcription(NAME, LANGUAGES[0]) if settings.transcription != "off" and installed() else None


def _transcription(state: ServerState, offer: Offer, realtime: bool) -> Transcription | None:
    """The new call's transcription: the offer's, else (a page call) the server's default; ApiError where it asks
    for captions this server cannot make. (A Realtime call's comes with its session, applied after.)"""
    if offer.transcription is None:
        return None if realtime or state.captions is None else default_transcription(state.settings)
    if offer.transcription == OFF:
        return None
    if state.captions is None:
        raise ApiError(400, "unsupported_value", "input_audio_transcription: this server makes no captions (the "
                       "speech recogniser is not installed, or --transcription off)")
    return offer.transcription


def call_ended(state: ServerState, vad: SpeechProbability, call: Any) -> None:
    """A call (or a Realtime WebSocket) is over: out of the registry, its VAD model back to the pool."""
    state.sessions.remove(call)
    state.vads.release(vad)


def _call(request: web.Request) -> CallSession:
    call = request.app[STATE].sessions.get(request.match_info["session_id"])
    if call is None:
        raise ApiError(404, "session_not_found", "no call with this id")
    return call


async def session_status(request: web.Request) -> web.Response:
    """Is this call here, and is its connection up or waiting for the caller to resume it?"""
    call = _call(request)
    return web.json_response({"session_id": call.id, "status": "waiting_for_resume" if call.parked else "active"})


async def hang_up(request: web.Request) -> web.Response:
    call = _call(request)
    await call.close("hung up")
    return web.json_response({"session_id": call.id, "status": "closed"})
