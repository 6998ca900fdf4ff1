"""One aiortc call to an rtc-agent server: the offer, the `events` channel, and the answer audio as it arrives."""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import aiohttp
import av
import numpy as np
from aiortc import MediaStreamTrack, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from ..media.ice import ice_servers_from_config, rtc_configuration
from ..media.inbound import Downmixer, use_low_latency_audio

RECORD_RATE = 24_000


class CallError(Exception):
    """The server refused the call (the contract's JSON error; 503s say when to try again in Retry-After)."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 reason: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s
        self.reason = reason  # server_full: slots or memory


@dataclass
class ReceivedAudio:
    """The agent's audio as decoded here: one entry per decoded frame (one per RTP packet)."""

    times: list[float] = field(default_factory=list)  # time.monotonic() at arrival
    pts: list[int] = field(default_factory=list)  # RTP timestamps (48 kHz)
    decoded: list[int] = field(default_factory=list)  # samples per channel the packet decoded to (48 kHz)
    samples: list[np.ndarray] = field(default_factory=list)  # mono float32 at RECORD_RATE

    def waveform(self) -> np.ndarray:
        return np.concatenate(self.samples) if self.samples else np.zeros(0, np.float32)

    def first_sound_after(self, t: float, until: float = float("inf"), level: float = 1e-3) -> float | None:
        """Arrival time of the first frame after `t` whose peak is above `level` (silence packets decode to ~0)."""
        for at, chunk in zip(self.times, self.samples):
            if t <= at < until and len(chunk) and float(np.max(np.abs(chunk))) > level:
                return at
        return None


async def server_ice_servers(url: str, token: str | None = None, verify_tls: bool = True) -> list[RTCIceServer]:
    """The ICE servers the server hands its callers in /api/config (TURN with fresh, expiring credentials)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url.rstrip('/')}/api/config", headers=headers, ssl=None if verify_tls else False) as r:
            if r.status != 200:
                raise CallError(r.status, "config_unavailable", await r.text())
            return ice_servers_from_config((await r.json())["ice_servers"])


def _seconds(header: str | None) -> float | None:
    """A Retry-After header in its delta-seconds form (the server sends no dates)."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


class Call:
    """An aiortc peer that calls `url`. Events land in `events` (with arrival times) and in `queue`.

    `resume()` replaces a dead connection with a new one for the same call (aiortc has no ICE restart)."""

    def __init__(self, url: str, *, token: str | None = None, voice: str | None = None,
                 instructions: str | None = None, ice_servers: Iterable[str | RTCIceServer] = (),
                 relay_only: bool = False, verify_tls: bool = True,
                 on_audio: Callable[[np.ndarray], None] | None = None, captions: bool = True) -> None:
        """`captions` False: the offer asks for no captions of the caller's words (input_audio_transcription
        null); True: the server's default."""
        self.url = url.rstrip("/")
        self.token, self.voice, self.instructions = token, voice, instructions
        self.captions = captions
        self._configuration = rtc_configuration(ice_servers, relay_only)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.audio = ReceivedAudio()
        self.session_id: str | None = None
        self.resume_token: str | None = None  # from session.created
        self.on_audio = on_audio  # gets each decoded frame (mono float32, RECORD_RATE) as it arrives
        self._ssl: ssl.SSLContext | bool = True if verify_tls else False
        self._reader: asyncio.Task[None] | None = None
        self._new_peer()

    def _new_peer(self) -> None:
        self.pc = RTCPeerConnection(self._configuration)
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.pc.on("track", self._on_track)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def connect(self, microphone: MediaStreamTrack, camera: MediaStreamTrack | None = None,
                      timeout_s: float = 20.0) -> None:
        body: dict[str, Any] = {}
        if self.voice:
            body["voice"] = self.voice
        if self.instructions is not None:
            body["instructions"] = self.instructions
        if not self.captions:
            body["input_audio_transcription"] = None
        await self._offer(body, microphone, camera, timeout_s)

    async def resume(self, microphone: MediaStreamTrack, camera: MediaStreamTrack | None = None,
                     timeout_s: float = 20.0) -> None:
        """Drops this peer connection and connects a new one to the same call with the resume token."""
        if not self.resume_token:
            raise ValueError("no resume token yet: session.created has not arrived")
        for sender in self.pc.getSenders():  # aiortc stops a sender's track on close: keep ours for the new one
            sender.replaceTrack(None)
        await self.close()
        self._new_peer()
        await self._offer({"resume_token": self.resume_token}, microphone, camera, timeout_s)

    async def _offer(self, body: dict[str, Any], microphone: MediaStreamTrack, camera: MediaStreamTrack | None,
                     timeout_s: float) -> None:
        self.pc.addTrack(microphone)
        if camera is not None:
            self.pc.addTrack(camera)
        use_low_latency_audio(self.pc)
        await self.pc.setLocalDescription(await self.pc.createOffer())
        body = {"sdp": self.pc.localDescription.sdp, "type": "offer", **body}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.url}/api/offer", json=body, headers=self._headers(), ssl=self._ssl) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    err = data.get("error", {}) if isinstance(data, dict) else {}
                    raise CallError(r.status, err.get("code", "error"), err.get("message", str(data)),
                                    _seconds(r.headers.get("Retry-After")), err.get("reason"))
        self.session_id = data["session_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type=data["type"]))
        await asyncio.wait_for(self.opened.wait(), timeout_s)

    def selected_candidate_types(self) -> tuple[str, str]:
        """(local, remote) candidate types of the pair ICE selected, e.g. ("relay", "host"). aiortc's getStats
        has no candidate-pair entry, so this reads aioice's nominated pair (the one bundled transport)."""
        connection = self.pc.sctp.transport.transport.iceGatherer._connection
        pair = connection._nominated[1]
        return pair.local_candidate.type, pair.remote_candidate.type

    def _on_message(self, text: str) -> None:
        msg = json.loads(text)
        if msg.get("type") == "session.created":
            self.resume_token = msg["session"].get("resume", {}).get("token")
        self.events.append((time.monotonic(), msg))
        self.queue.put_nowait(msg)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._reader = asyncio.ensure_future(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        downmix = Downmixer(RECORD_RATE)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if not isinstance(frame, av.AudioFrame):
                continue
            self.audio.times.append(time.monotonic())
            self.audio.pts.append(int(frame.pts or 0))
            self.audio.decoded.append(frame.samples)
            samples = downmix(frame)
            self.audio.samples.append(samples)
            if self.on_audio is not None:
                self.on_audio(samples)

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(json.dumps(message))

    async def next_event(self, *types: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The next event of one of `types` (all others are skipped; they stay in `events`)."""
        async def wait() -> dict[str, Any]:
            while True:
                msg = await self.queue.get()
                if not types or msg["type"] in types:
                    return msg
        return await asyncio.wait_for(wait(), timeout_s)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [m for _, m in self.events if m["type"] == kind]

    async def packets_received(self) -> int:
        """inbound-rtp packetsReceived of the agent's audio."""
        total = 0
        for transceiver in self.pc.getTransceivers():
            if transceiver.kind == "audio":
                for stat in (await transceiver.receiver.getStats()).values():
                    if stat.type == "inbound-rtp":
                        total += stat.packetsReceived
        return total

    async def hang_up(self) -> None:
        """DELETE the session (when it still exists), then close the peer connection."""
        if self.session_id and self.pc.connectionState != "closed":
            try:
                async with aiohttp.ClientSession() as http:
                    url = f"{self.url}/api/sessions/{self.session_id}"
                    async with http.delete(url, headers=self._headers(), ssl=self._ssl) as r:
                        await r.read()
            except aiohttp.ClientError:
                pass
        await self.close()

    async def close(self) -> None:
        await self.pc.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
