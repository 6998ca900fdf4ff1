"""Caller audio in: no needless receive buffering, 48 kHz stereo s16 -> 16 kHz mono float32, fixed-size chunks."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterator

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtpPacket
from aiortc.utils import uint16_gt

INPUT_RATE = 16_000


class InOrderAudioBuffer(JitterBuffer):
    """Hands each audio packet to the decoder as it arrives.

    An Opus RTP packet is always a whole frame, so waiting for later packets (aiortc waits for 4: 80 ms on
    20 ms packets, 320 ms on 80 ms packets) only adds delay. Packets older than the last one handed on arrive
    too late to play and are dropped (a reordered or duplicated packet): the decoder sees that as a loss.
    `on_packet(kept)` hears of every packet that arrived: kept (handed on) or dropped here. Packets the network
    lost never arrive, so they are not counted here (the receiver's RTP statistics count them).
    """

    def __init__(self, on_packet: Callable[[bool], None] | None = None) -> None:
        super().__init__(capacity=16)
        self._last: int | None = None
        self._on_packet = on_packet

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        kept = self._last is None or uint16_gt(packet.sequence_number, self._last)
        if self._on_packet is not None:
            self._on_packet(kept)
        if not kept:
            return False, None
        self._last = packet.sequence_number
        return False, JitterFrame(data=packet._data, timestamp=packet.timestamp)  # type: ignore[attr-defined]


def use_low_latency_audio(pc: RTCPeerConnection, on_packet: Callable[[bool], None] | None = None) -> None:
    """Gives every audio receiver of `pc` an InOrderAudioBuffer (aiortc keeps its buffer in a private attribute),
    which tells `on_packet` of each packet that arrived (InOrderAudioBuffer).

    Call it before media flows: after setRemoteDescription on the answering side, after addTransceiver on the
    offering side.
    """
    attr = "_RTCRtpReceiver__jitter_buffer"
    for transceiver in pc.getTransceivers():
        if transceiver.kind == "audio" and hasattr(transceiver.receiver, attr):
            setattr(transceiver.receiver, attr, InOrderAudioBuffer(on_packet))


class Downmixer:
    """Decoded WebRTC audio frames (s16 or float, packed or planar, any rate) -> mono float32 at `rate`.

    Channels are averaged here: swresample's stereo->mono mixes at -3 dB per channel, which makes the
    two identical channels of a mono microphone 3 dB louder (and lets full-scale speech clip).
    """

    def __init__(self, rate: int = INPUT_RATE) -> None:
        self._rate = rate
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)

    def __call__(self, frame: av.AudioFrame) -> np.ndarray:
        data = frame.to_ndarray()
        channels = len(frame.layout.channels)
        mono = data.mean(axis=0) if frame.format.is_planar else data.reshape(-1, channels).mean(axis=1)
        if frame.format.name.startswith("s16"):
            mono = mono / 32768.0
        mono = mono.astype(np.float32)
        if frame.sample_rate == self._rate:
            return mono
        mixed = av.AudioFrame.from_ndarray(mono.reshape(1, -1), format="flt", layout="mono")
        mixed.sample_rate = frame.sample_rate
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(mixed)]
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)


class Chunker:
    """Cuts a stream of samples into chunks of exactly `size` samples."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pending = np.zeros(0, np.float32)

    def push(self, samples: np.ndarray) -> Iterator[np.ndarray]:
        buf = np.concatenate([self._pending, samples]) if len(self._pending) else samples
        n = len(buf) // self.size * self.size
        for i in range(0, n, self.size):
            yield buf[i : i + self.size]
        self._pending = buf[n:].copy()


class PeerSilent(Exception):
    """No audio frame arrived for the allowed time: the peer is gone (closed tab, lost network)."""


async def audio_chunks(
    track: MediaStreamTrack, size: int, timeout_s: float, first_timeout_s: float
) -> AsyncIterator[np.ndarray]:
    """Reads a received audio track as 16 kHz mono float32 chunks of `size` samples until the track ends.

    Raises PeerSilent when the first frame takes longer than `first_timeout_s` (connecting) or a later one
    longer than `timeout_s` (ICE itself takes 30 s to give up on a vanished peer). It waits with asyncio.timeout,
    not wait_for: on Python 3.11 wait_for runs recv() in a task of its own, and that task, the track's
    MediaStreamError and this frame form a reference cycle that would keep the resampler (and its libav threads)
    until a cyclic GC pass.
    """
    downmix, chunker = Downmixer(), Chunker(size)
    wait = first_timeout_s
    while True:
        try:
            async with asyncio.timeout(wait):
                frame = await track.recv()
        except TimeoutError:
            raise PeerSilent(f"no audio for {wait:.0f} s") from None
        except MediaStreamError:
            return
        wait = timeout_s
        if not isinstance(frame, av.AudioFrame):
            continue
        for chunk in chunker.push(downmix(frame)):
            yield chunk
