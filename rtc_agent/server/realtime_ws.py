"""One Realtime WebSocket client (`GET /v1/realtime`): PCM16 in through `input_audio_buffer.append`, the same
conversation (turn detection, barge-in, engine) as a WebRTC call, answers out as `response.output_audio.delta`."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any, Callable

from aiohttp import WSMsgType, web

from ..config import Settings
from ..conversation import Conversation
from ..engine.ipc.session_protocol import EngineSession
from ..media.captions import CaptionPool
from ..media.end_of_turn import EndOfTurnScorer
from ..media.pcm import PacedPcmOutput, PcmInput
from ..media.vad import CHUNK_SAMPLES, SpeechProbability
from .metrics import Metrics
from .realtime import RealtimeEvents

log = logging.getLogger(__name__)
MAX_UNSENT_EVENTS = 4096  # a client that stops reading is disconnected rather than buffered without end
CHUNKS_PER_YIELD = 32  # ~1 s of audio through the turn detector (~10 ms of CPU), then other calls get the loop


class RealtimeSocket:
    def __init__(self, ws: web.WebSocketResponse, settings: Settings, engine_session: EngineSession,
                 vad: SpeechProbability, metrics: Metrics, model: Any, voice: str, instructions: str,
                 on_closed: Callable[["RealtimeSocket"], None], end_of_turn: EndOfTurnScorer | None = None,
                 speech: bool = True, tag: str = "", captions: CaptionPool | None = None) -> None:
        self.id = f"sess_{tag}{secrets.token_urlsafe(9)}"
        self.ws = ws
        self.started_at = time.monotonic()
        self.first_packet_ms: list[float] = []
        self._metrics = metrics
        self._on_closed = on_closed
        self._unsent: asyncio.Queue[str | None] = asyncio.Queue()
        self._closing: asyncio.Task[None] | None = None
        self.realtime = RealtimeEvents(self._send, "websocket", self.id, model, voice, instructions)
        self.output = PacedPcmOutput(self.realtime.audio_frame)
        self.conversation = Conversation(engine_session, self.output, self.realtime.conversation_event, vad,
                                         settings.turn, on_answer=self._answered, end_of_turn=end_of_turn,
                                         speech=speech, loop_lag_since=metrics.loop_lag.max_since,
                                         captions=captions)
        self.realtime.bind(self.conversation)
        self.realtime.on_audio = self._audio
        self._input = PcmInput(CHUNK_SAMPLES)
        self._appended: list[bytes] = []  # audio of the event being handled, fed before the next event

    def _send(self, event: dict[str, Any]) -> None:
        if self._unsent.qsize() >= MAX_UNSENT_EVENTS:
            self.close("client not reading")
            return
        self._unsent.put_nowait(json.dumps(event, separators=(",", ":")))

    def _audio(self, data: bytes) -> None:
        self._appended.append(data)

    async def _feed(self) -> None:
        """The appended audio into the conversation, in order, before the client's next event is handled; a long
        append (a file sent at once) lets the event loop serve other calls as it goes."""
        appended, self._appended = self._appended, []
        for data in appended:
            for i, chunk in enumerate(self._input.push(data), 1):
                self.conversation.feed(chunk)
                if i % CHUNKS_PER_YIELD == 0:
                    await asyncio.sleep(0)

    def _answered(self, metrics: dict[str, Any]) -> None:
        self._metrics.answer(metrics)
        if metrics["ttfp_ms"] is not None:
            self.first_packet_ms.append(metrics["ttfp_ms"])

    async def run(self) -> None:
        """Serves the client until either side closes."""
        writer = asyncio.create_task(self._write(), name=f"{self.id}-ws-out")
        pump = asyncio.create_task(self.output.run(), name=f"{self.id}-audio-out")
        self.realtime.opened()
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    self.realtime.receive(msg.data)
                    await self._feed()
                elif msg.type == WSMsgType.BINARY:
                    self.realtime.error("invalid_json", "events are JSON text frames")
        finally:
            pump.cancel()
            self._unsent.put_nowait(None)
            await asyncio.gather(pump, return_exceptions=True)
            await self.close("client closed the socket")
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _write(self) -> None:
        while (text := await self._unsent.get()) is not None:
            await self.ws.send_str(text)

    def close(self, reason: str) -> asyncio.Task[None]:
        """Ends the session (idempotent); the returned task finishes once everything is freed."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(reason))
        return self._closing

    async def _close(self, reason: str) -> None:
        try:
            await self.conversation.close()
        except Exception:
            log.exception("websocket %s: closing the engine session failed", self.id)
        finally:
            self._on_closed(self)
            await self.ws.close()
        ttfp = ", ".join(f"{v:.0f}" for v in self.first_packet_ms) or "-"
        log.info("websocket %s ended (%s) after %.1f s; first-packet latency per answer: %s ms",
                 self.id, reason, time.monotonic() - self.started_at, ttfp)
