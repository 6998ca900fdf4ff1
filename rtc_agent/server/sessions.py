"""Calls in progress: each has its peer connection, engine session, conversation and tasks, and frees them all."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

import numpy as np
from aiortc import MediaStreamTrack, RTCDataChannel, RTCPeerConnection

from ..config import Settings
from ..conversation import Conversation, ConversationError, EngineSession
from ..media.end_of_turn import EndOfTurnScorer
from ..media.inbound import PeerSilent, audio_chunks
from ..media.outbound import OutboundAudioTrack
from ..media.vad import CHUNK_SAMPLES, SpeechProbability
from ..media.video import sample_video
from .metrics import Metrics
from .protocol import (CancelResponse, Commit, ProtocolError, SessionUpdate, error_event, parse_client_message,
                       turn_description)

log = logging.getLogger(__name__)
FIRST_AUDIO_TIMEOUT_S = 8.0  # ICE and DTLS must be through by then (a failed ICE is freed within 10 s)
MAX_PENDING_EVENTS = 256


class EventChannel:
    """The `events` data channel. What is sent before the client's channel is open waits for it."""

    def __init__(self) -> None:
        self._channel: RTCDataChannel | None = None
        self._pending: list[str] = []

    def attach(self, channel: RTCDataChannel, on_message: Callable[[Any], None]) -> None:
        self._channel = channel
        channel.on("message", on_message)
        if channel.readyState == "open":
            self._flush()
        else:
            channel.on("open", self._flush)

    def send(self, message: dict[str, Any]) -> None:
        text = json.dumps(message, separators=(",", ":"))
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)
        elif channel is None and len(self._pending) < MAX_PENDING_EVENTS:
            self._pending.append(text)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for text in pending:
            if self._channel is not None and self._channel.readyState == "open":
                self._channel.send(text)


class CallSession:
    def __init__(self, settings: Settings, pc: RTCPeerConnection, engine_session: EngineSession,
                 vad: SpeechProbability, metrics: Metrics, describe: dict[str, Any], voice: str, instructions: str,
                 on_closed: Callable[["CallSession"], None], end_of_turn: EndOfTurnScorer | None = None) -> None:
        self.id = "sess_" + secrets.token_urlsafe(9)
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
        self.conversation = Conversation(engine_session, self.track, self.events.send, vad, settings.turn,
                                         on_answer=self._answered, end_of_turn=end_of_turn)
        pc.on("datachannel", self._on_datachannel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_connection_state)

    # ---- wiring -------------------------------------------------------------------------------------------
    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label == "events":
            self.events.attach(channel, self._on_message)
            self.events.send({"type": "session.created", "session": self.description()})

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
            self.close("peer gone (connection failed)")

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
            self.close(f"peer gone ({exc})")

    def _on_message(self, text: Any) -> None:
        conversation = self.conversation
        try:
            msg = parse_client_message(text, conversation.turn)
            if isinstance(msg, SessionUpdate):
                try:
                    conversation.update(msg.voice, msg.instructions, msg.turn)
                except ValueError as exc:
                    raise ProtocolError("invalid_value", str(exc)) from None
                self.voice = msg.voice or self.voice
                self.instructions = msg.instructions if msg.instructions is not None else self.instructions
                self.events.send({"type": "session.updated", "session": self.description()})
            elif isinstance(msg, Commit):
                conversation.commit()
            elif isinstance(msg, CancelResponse):
                conversation.cancel_response()
        except (ProtocolError, ConversationError) as exc:
            self.events.send(error_event(exc.code, exc.message))

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
            "input_audio": {"sample_rate": 16000, "vad": "silero"},
            "output_audio": {"codec": "opus", "packet_ms": 80, "sample_rate": 24000},
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

    def close(self, reason: str) -> asyncio.Task[None]:
        """Ends the call (idempotent); the returned task finishes once everything is freed."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(reason))
        return self._closing

    async def _close(self, reason: str) -> None:
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        try:
            await self.conversation.close()
        except Exception:
            log.exception("call %s: closing the engine session failed", self.id)
        finally:
            self.track.stop()
            try:
                await self.pc.close()
            finally:
                self._on_closed(self)
        ttfp = ", ".join(f"{v:.0f}" for v in self.first_packet_ms) or "-"
        log.info("call %s ended (%s) after %.1f s; first-packet latency per answer: %s ms",
                 self.id, reason, time.monotonic() - self.started_at, ttfp)


class Full(Exception):
    pass


class Sessions:
    """The registry of calls, with the capacity limit (slots are reserved while an offer is being answered)."""

    def __init__(self, max_sessions: int, metrics: Metrics) -> None:
        self.max_sessions = max_sessions
        self.metrics = metrics
        self._calls: dict[str, CallSession] = {}
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._calls)

    def reserve(self) -> None:
        if len(self._calls) + self._reserved >= self.max_sessions:
            raise Full
        self._reserved += 1

    def release(self) -> None:
        self._reserved -= 1

    def add(self, call: CallSession) -> None:
        self._calls[call.id] = call
        self.metrics.sessions.inc()
        self.metrics.active_sessions.set(len(self._calls))

    def get(self, session_id: str) -> CallSession | None:
        return self._calls.get(session_id)

    def remove(self, call: CallSession) -> None:
        self._calls.pop(call.id, None)
        self.metrics.active_sessions.set(len(self._calls))

    async def close_all(self, reason: str) -> None:
        await asyncio.gather(*(c.close(reason) for c in list(self._calls.values())), return_exceptions=True)
