"""Raw PCM16 audio for transports without RTP (the Realtime WebSocket): caller audio in, answers out.

In: little-endian PCM16 mono at 24 kHz (what `input_audio_buffer.append` carries), resampled to the 16 kHz float
chunks the turn detector and the engine take, as WebRTC audio is.

Out: an answer's 80 ms frames as PCM16 at 24 kHz, handed on at the pace they are played, as the WebRTC track
does, so the conversation's state (speaking, barge-in, the frames the caller heard) means the same on both
transports. A WebSocket client buffers what it plays, so frames may run `lead_s` ahead of real time: jitter on
the socket does not starve its player, and a barge-in finds at most that much audio sent but unheard (the
client's `conversation.item.truncate` says exactly how much it played).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterator

import av
import numpy as np

from .inbound import Chunker, Downmixer
from .outbound import PACKET_S, SAMPLE_RATE, AnswerOutput, Playout

PCM_RATE = SAMPLE_RATE  # 24 kHz both ways, as the Realtime API's audio/pcm format
LEAD_S = 0.16  # two frames


class PcmInput:
    """PCM16 mono bytes at 24 kHz in, 16 kHz mono float32 chunks of `size` samples out."""

    def __init__(self, size: int) -> None:
        self._downmix = Downmixer()
        self._chunker = Chunker(size)
        self._odd = b""  # a trailing half sample from the previous append
        self._pts = 0

    def push(self, data: bytes) -> Iterator[np.ndarray]:
        data = self._odd + data
        whole = len(data) // 2 * 2
        self._odd = data[whole:]
        if not whole:
            return iter(())
        samples = np.frombuffer(data[:whole], dtype="<i2").reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = PCM_RATE
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return self._chunker.push(self._downmix(frame))


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian PCM16."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class PacedPcmOutput(AnswerOutput):
    """Each answer's frames go to `send` (PCM16 bytes) at most `lead_s` ahead of real time, from the moment its
    first frame is ready. A frame that is ready only after its moment (an engine slower than real time) counts as
    late, and the clock restarts from it, as the WebRTC track's gap packet shifts the rest of that answer."""

    def __init__(self, send: Callable[[bytes], None], lead_s: float = LEAD_S) -> None:
        super().__init__()
        self._send = send
        self.lead_s = lead_s
        self._new = asyncio.Event()

    def _started(self) -> None:
        self._new.set()

    async def run(self) -> None:
        """Sends answers as they come, until cancelled."""
        while True:
            await self._new.wait()
            self._new.clear()
            playout = self._playout
            if playout is not None:
                await self._play(playout)

    async def _play(self, playout: Playout) -> None:
        start: float | None = None
        while not playout.done.is_set():
            if not playout.queued:
                await playout.changed()
                continue
            index, now = playout.frames_sent, time.monotonic()
            if start is None:
                start = now
            elif now > start + index * PACKET_S:  # its moment passed: the client's player ran dry
                playout.frames_late += 1
                start = now - index * PACKET_S
            due = start + index * PACKET_S - self.lead_s
            if due > now:
                await asyncio.sleep(due - now)
                continue  # (it may have been interrupted meanwhile)
            frame = playout.take()
            if frame is not None:
                self._send(to_pcm16(frame))
