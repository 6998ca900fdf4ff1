"""Calls in progress: each has its peer connection, engine session, conversation and tasks, and frees them all."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from typing import Any, Awaitable, Callable, Iterator

import numpy as np
from aiortc import MediaStreamTrack, RTCDataChannel, RTCPeerConnection

from ..config import Settings
from ..conversation import Conversation, ConversationError
from ..engine.ipc.session_protocol import EngineSession
from ..media.captions import CaptionPool, Transcription
from ..media.end_of_turn import EndOfTurnScorer
from ..media.inbound import PeerSilent, audio_chunks
from ..media.outbound import OutboundAudioTrack
from ..media.vad import CHUNK_SAMPLES, SpeechProbability
from ..media.video import sample_video
from .metrics import Metrics
from .protocol import (CancelResponse, Commit, CreateResponse, ProtocolError, SessionUpdate, ToolOutput, error_event,
                       output_modalities, parse_client_message, tool_description, transcription_description,
                       turn_description)
from .realtime import RealtimeEvents

log = logging.getLogger(__name__)
# The connect deadline: ICE and DTLS must be through, and the first audio in, this long after the offer is applied
# (a call that never connected then ends: a failed ICE, or an offer nobody answers, is freed within 10 s)
FIRST_AUDIO_TIMEOUT_S = 8.0
MAX_PENDING_EVENTS = 256
DRAIN_S = 1.0  # how long a last event may take to leave before the call is hung up


class EventChannel:
    """The `events` data channel. What is sent before the client's channel is open waits for it."""

    def __init__(self) -> None:
        self._channel: RTCDataChannel | None = None
        self._pending: list[str] = []

    def attach(self, channel: RTCDataChannel, on_message: Callable[[Any], None], first: Callable[[], None]) -> None:
        """Sends on `channel` from now on (a resumed call attaches its new peer connection's channel). Once it is
        open, `first()` sends what must come before the events that waited for it (session.created: the caller's
        audio can arrive before the channel opens, and its speech_started with it)."""
        self._channel = channel
        channel.on("message", on_message)
        if channel.readyState == "open":
            self._opened(first)
        else:
            channel.once("open", lambda: self._opened(first))

    def send(self, message: dict[str, Any]) -> None:
        text = json.dumps(message, separators=(",", ":"))
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)
        elif len(self._pending) < MAX_PENDING_EVENTS:
            self._pending.append(text)

    def _opened(self, first: Callable[[], None]) -> None:
        pending, self._pending = self._pending, []
        first()
        for text in pending:
            if self._channel is not None and self._channel.readyState == "open":
                self._channel.send(text)

    async def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Waits (at most `timeout_s`) until what was sent has left the channel's buffer."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self._channel is not None and self._channel.bufferedAmount > 0 and loop.time() < end:
            await asyncio.sleep(0.02)

    def detach(self) -> None:
        """Drops the channel and its listeners (they refer back to the call). What is sent until a channel is
        attached again waits for it (a call whose connection died may be resumed)."""
        if self._channel is not None:
            self._channel.remove_all_listeners()
        self._channel = None


class CallSession:
    """One call. Its peer connection may change: when the connection dies (no audio for `peer_timeout_s`, or
    ICE failed) the call is parked for `resume_window_s` with its conversation and engine session intact, and
    an offer carrying the call's resume token attaches a new peer connection to it (aiortc has no ICE restart).
    Only a caller who has its resume token (`session.created`, on the data channel) can come back: a call that
    never connected, or a Realtime client's, ends instead of being parked."""

    def __init__(self, settings: Settings, pc: RTCPeerConnection, engine_session: EngineSession,
                 vad: SpeechProbability, metrics: Metrics, describe: dict[str, Any], voice: str, instructions: str,
                 on_closed: Callable[["CallSession"], None], realtime: bool = False,
                 end_of_turn: EndOfTurnScorer | None = None, tag: str = "", moved: bool = False,
                 ice: str = "", captions: CaptionPool | None = None,
                 transcription: Transcription | None = None) -> None:
        """`moved`: the call of a media process that died, its engine session taken over here: the caller is told
        with an `error` event after `session.created` (the call has a new id and resume token, of this process).
        `ice`: the ICE credentials of the offer `pc` answers (Sessions.answering). `captions`: the process's speech
        recogniser; `transcription`: this call's captions setting."""
        speech = bool(describe.get("speech", True))
        self.id = f"sess_{tag}{secrets.token_urlsafe(9)}"
        self.resume_token = tag + secrets.token_urlsafe(24)
        self.ice = ice
        self._token_sent = False  # session.created (with the resume token) went out: the caller can resume
        self._moved = moved
        self.settings = settings
        self.pc = pc
        self.metrics = metrics
        self.voice, self.instructions = voice, instructions
        self.started_at = time.monotonic()
        self.events = EventChannel()
        self.track = OutboundAudioTrack()
        self.first_packet_ms: list[float] = []
        self._describe = describe
        self._on_closed = on_closed
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None  # while parked: ends the call when nobody resumes it
        self._retired: set[asyncio.Task[None]] = set()  # old peer connections being closed
        # a Realtime API client (/v1/realtime/calls) gets the Realtime events on "oai-events"; our page, ours
        self.realtime = RealtimeEvents(self.events.send, "webrtc", self.id, describe.get("model"), voice,
                                       instructions) if realtime else None
        send = self.realtime.conversation_event if self.realtime else lambda event: self.events.send(event.as_json())
        self.conversation = Conversation(engine_session, self.track, send, vad, settings.turn,
                                         on_answer=self._answered, end_of_turn=end_of_turn, speech=speech,
                                         loop_lag_since=metrics.loop_lag.max_since, captions=captions,
                                         transcription=transcription)
        if self.realtime:
            self.realtime.bind(self.conversation)
        self._wire(pc)
        self._spawn(self._enforce_limits(), "limits")

    @property
    def parked(self) -> bool:
        return self._expiry is not None

    @property
    def closing(self) -> bool:
        return self._closing is not None

    # ---- wiring -------------------------------------------------------------------------------------------
    def _wire(self, pc: RTCPeerConnection) -> None:
        """Listens to `pc`; its events stop counting once the call has moved on to another peer connection."""
        for event, callback in (("datachannel", self._on_datachannel), ("track", self._on_track),
                                ("connectionstatechange", self._on_connection_state)):
            pc.on(event, self._guarded(callback, lambda: pc is self.pc))

    def _guarded(self, callback: Callable[..., None], current: Callable[[], bool] = lambda: True
                 ) -> Callable[..., None]:
        """aiortc runs these callbacks inside its own DTLS/SCTP loops: an exception there would tear the
        connection down without a word to the caller. Here it is logged and the caller gets an `error` event;
        the call goes on. `current`: whether the callback still counts (its peer connection is the call's)."""
        def run(*args: Any) -> None:
            if not current():
                return
            try:
                callback(*args)
            except Exception:
                log.exception("call %s: %s failed", self.id, getattr(callback, "__name__", "a callback"))
                self.events.send(error_event("internal_error", "the server failed to handle this", "server_error"))
        return run

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if self.realtime is not None and channel.label == "oai-events":
            self.events.attach(channel, self._guarded(self.realtime.receive), self.realtime.opened)
        elif self.realtime is None and channel.label == "events":
            self.events.attach(channel, self._guarded(self._on_message), self._greet)

    def _greet(self) -> None:
        """session.created, first on the data channel (and where the call moved here, the error that says so)."""
        self.events.send({"type": "session.created", "session": self.description()})
        self._token_sent = True
        if self._moved:
            self._moved = False
            self.events.send(error_event("media_process_failed", "the server process that carried this call "
                                         "stopped; the call goes on in another with its conversation, under "
                                         "a new id (the answer in progress was lost)", "server_error"))

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._spawn(self._listen(track), "audio-in")
        elif track.kind == "video":  # only when the offer sends video; it may come and go (replaceTrack)
            s = self.settings
            self._spawn(sample_video(track, self._on_image, s.video_fps, s.video_max_side,
                                     on_frame=self.metrics.video_frames_received.inc), "video-in")

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "closed":  # the caller closed its peer connection: a hang-up, whether or not a DELETE comes
            self.close("hung up")
        elif state == "failed":
            self.lose("connection failed")

    def _on_image(self, image: np.ndarray) -> None:
        self.metrics.video_frames_sampled.inc()
        self.conversation.see(image)

    async def _listen(self, track: MediaStreamTrack) -> None:
        chunks = audio_chunks(track, CHUNK_SAMPLES, self.settings.peer_timeout_s, FIRST_AUDIO_TIMEOUT_S)
        try:
            async for chunk in chunks:
                self.conversation.feed(chunk)
            self.close("hung up")  # the caller's audio track ended
        except PeerSilent as exc:
            self.lose(str(exc))

    def _on_message(self, text: Any) -> None:
        conversation = self.conversation
        try:
            msg = parse_client_message(text, conversation.turn)
            if isinstance(msg, SessionUpdate):
                try:
                    conversation.update(msg.voice, msg.instructions, msg.turn, msg.text_only,
                                        msg.tool_set(conversation.tools), language=msg.language,
                                        transcription=msg.transcription)
                except ValueError as exc:
                    raise ProtocolError("invalid_value", str(exc)) from None
                self.voice = msg.voice or self.voice
                self.instructions = msg.instructions if msg.instructions is not None else self.instructions
                self.events.send({"type": "session.updated", "session": self.description()})
            elif isinstance(msg, Commit):
                conversation.commit()
            elif isinstance(msg, CancelResponse):
                conversation.cancel_response()
            elif isinstance(msg, ToolOutput):
                conversation.add_tool_output(msg.call_id, msg.output)
            elif isinstance(msg, CreateResponse):
                conversation.create_response()
        except (ProtocolError, ConversationError) as exc:
            self.events.send(error_event(exc.code, exc.message))

    async def _enforce_limits(self) -> None:
        """Ends the call at the idle limit (no caller speech and no answer for idle_timeout_s) or at max_call_s,
        with an `error` event first so that the client can tell the caller why."""
        s = self.settings
        while True:
            limits = []
            if s.max_call_s:
                limits.append((self.started_at + s.max_call_s, "session_expired",
                               f"the call reached its maximum length of {s.max_call_s:g} s"))
            if s.idle_timeout_s:
                limits.append((self.conversation.last_active_at + s.idle_timeout_s, "idle_timeout",
                               f"nobody spoke for {s.idle_timeout_s:g} s"))
            if not limits:
                return
            at, code, message = min(limits)
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # (the caller may have spoken meanwhile: look again)
                continue
            self.events.send(error_event(code, f"{message}: the call is ended", "server_error"))
            await self.events.drain()
            self.close(code)
            return

    def _answered(self, metrics: dict[str, Any]) -> None:
        self.metrics.answer(metrics)
        if metrics["ttfp_ms"] is not None:
            self.first_packet_ms.append(metrics["ttfp_ms"])

    def description(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self._describe.get("model"),
            "voice": self.voice,
            "instructions": self.instructions,
            "turn_detection": turn_description(self.conversation.turn),
            "turn_detection_note": self.settings.turn_detection_note,
            "input_audio_transcription": transcription_description(self.conversation.transcription),
            "input_audio_transcription_note": self.settings.transcription_note,
            "output_modalities": output_modalities(self.conversation.text_only),
            **tool_description(self.conversation.tools),
            "language": self.conversation.session.options.language,
            "input_audio": {"sample_rate": 16000, "vad": "silero"},
            "output_audio": {"codec": "opus", "packet_ms": 80, "sample_rate": 24000},
            "resume": {"token": self.resume_token, "window_s": self.settings.resume_window_s},
        }

    # ---- lifetime -----------------------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("call %s: task %s failed: %r", self.id, task.get_name(), task.exception())
            self.close("internal error")

    def lose(self, reason: str) -> None:
        """The caller's connection died: park the call for a resume, or end it when resuming is off or the caller
        has no resume token to come back with (it never connected: its slot comes back at once)."""
        if self.closing or self.parked:
            return
        if self.settings.resume_window_s <= 0 or not self._token_sent:
            self.close(f"peer gone ({reason})" if self._token_sent else f"never connected ({reason})")
            return
        log.info("call %s: connection lost (%s); waiting %g s for a resume", self.id, reason,
                 self.settings.resume_window_s)
        self._drop_connection()
        self._expiry = asyncio.ensure_future(self._expire(reason))

    def _drop_connection(self) -> None:
        """Cuts the answer in progress (nobody hears it) and lets go of the peer connection and its media."""
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if self.conversation.answering:
            self.conversation.cancel_response()
        self.conversation.input_lost()
        self.events.detach()
        self.track.stop()
        old, self.pc = self.pc, None
        closing = asyncio.ensure_future(old.close())
        self._retired.add(closing)
        closing.add_done_callback(self._retired.discard)

    async def _expire(self, reason: str) -> None:
        await asyncio.sleep(self.settings.resume_window_s)
        self._expiry = None
        self.close(f"peer gone ({reason}), not resumed")

    def resume(self, pc: RTCPeerConnection, track: OutboundAudioTrack, ice: str) -> None:
        """Goes on with a new peer connection (its offer, of ICE credentials `ice`, about to be answered with
        `track`), same conversation."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        else:  # the old connection still looks alive to us (the caller noticed first): let it go now
            self._drop_connection()
        self.pc, self.track, self.ice = pc, track, ice
        self.conversation.use_track(track)
        self._wire(pc)
        log.info("call %s resumed with a new peer connection", self.id)

    def close(self, reason: str) -> asyncio.Task[None]:
        """Ends the call (idempotent); the returned task finishes once everything is freed."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(reason))
        return self._closing

    async def _close(self, reason: str) -> None:
        current = asyncio.current_task()
        for task in [*self._tasks, self._expiry]:
            if task is not None and task is not current:
                task.cancel()
        try:
            await self.conversation.close()
        except Exception:
            log.exception("call %s: closing the engine session failed", self.id)
        finally:
            self.track.stop()
            try:
                if self.pc is not None:
                    await self.pc.close()
            except Exception:
                log.exception("call %s: closing the peer connection failed", self.id)
            finally:
                self._unwire()
                self._on_closed(self)
        ttfp = ", ".join(f"{v:.0f}" for v in self.first_packet_ms) or "-"
        log.info("call %s ended (%s) after %.1f s; first-packet latency per answer: %s ms",
                 self.id, reason, time.monotonic() - self.started_at, ttfp)

    def _unwire(self) -> None:
        """Drops the callbacks that tie the peer connection and the call to each other, so that an ended call is
        freed at once by reference counting (its codecs' threads with it), not by a later cyclic GC pass."""
        for emitter in _emitters(self.pc) if self.pc is not None else ():  # (None: parked when it ended)
            emitter.remove_all_listeners()
        self.events.detach()


def _emitters(pc: RTCPeerConnection) -> list[Any]:
    """The peer connection and its transports: aiortc's own listeners tie the transports back to the peer
    connection, and its close() removes only the peer connection's."""
    dtls = [t.receiver.transport for t in pc.getTransceivers()]
    sctp = [pc.sctp] if pc.sctp is not None else []
    dtls += [s.transport for s in sctp]
    ice = [d.transport for d in dtls]
    return [pc, *sctp, *dtls, *ice, *(i.iceGatherer for i in ice)]


class Full(Exception):
    pass


class Duplicate(Exception):
    """An offer already answered (or being answered): its peer can connect to one answer only."""


class Sessions:
    """The registry of calls, with the capacity limit (slots are reserved while an offer is being answered)."""

    def __init__(self, max_sessions: int, metrics: Metrics) -> None:
        self.max_sessions = max_sessions  # 0 until the engine is loaded: then its slot count, or fewer
        self.metrics = metrics
        self._calls: dict[str, CallSession] = {}
        self._reserved = 0
        self._answering: set[str] = set()  # the ICE credentials of offers being answered

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def free(self) -> int:
        """Call slots not taken (a parked call keeps its slot: its caller may come back)."""
        return self.max_sessions - len(self._calls) - self._reserved

    def reserve(self) -> None:
        if self.free <= 0:
            raise Full
        self._reserved += 1

    def release(self) -> None:
        self._reserved -= 1

    @contextlib.contextmanager
    def answering(self, ice: str) -> Iterator[None]:
        """While an offer of ICE credentials `ice` is answered (until its call is added): the same offer again,
        now or while a call's connection answers it, raises Duplicate. (A peer connects to one answer: a second
        call for its offer could only hold a slot until its connect deadline.)"""
        if ice in self._answering or any(isinstance(c, CallSession) and c.ice == ice for c in self._calls.values()):
            raise Duplicate
        self._answering.add(ice)
        try:
            yield
        finally:
            self._answering.discard(ice)

    def add(self, call: CallSession) -> None:
        self._calls[call.id] = call
        self.metrics.sessions.inc()
        self.metrics.active_sessions.set(len(self._calls))

    def get(self, session_id: str) -> CallSession | None:
        return self._calls.get(session_id)

    def by_resume_token(self, token: str) -> CallSession | None:
        for call in self._calls.values():
            if hmac.compare_digest(call.resume_token.encode(), token.encode()) and not call.closing:
                return call
        return None

    def calls(self) -> list[CallSession]:
        return list(self._calls.values())

    def remove(self, call: CallSession) -> None:
        self._calls.pop(call.id, None)
        self.metrics.active_sessions.set(len(self._calls))

    async def close_all(self, reason: str) -> None:
        await asyncio.gather(*(c.close(reason) for c in list(self._calls.values())), return_exceptions=True)
