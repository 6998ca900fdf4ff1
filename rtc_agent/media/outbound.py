"""The agent's voice out: one Opus packet per 80 ms frame, encoded here, paced in real time, silence between answers.

aiortc's own encoder cuts audio into 20 ms packets; handing it 80 ms frames breaks the audio. So
`recv()` returns an `av.Packet` that PyAV's libopus already encoded with frame_duration=80, which aiortc sends as
one RTP packet. libopus takes the engine's 24 kHz directly (Opus is band-limited, not tied to a rate), so
nothing is resampled; the RTP clock is 48 kHz as Opus requires: the timestamp steps 3840 per answer packet.

Between answers the stream goes on with 20 ms silence packets (one pre-encoded packet, sent again and again):
the receiver's clock never stops, so nothing bursts when speech resumes, and an answer's first packet waits
at most 20 ms for its slot instead of up to 80. From the turn's end until the answer's first frame is ready the
silence packets are 10 ms, and each one's slot waits up to its 10 ms for that frame: the first frame goes out the
moment it is ready, stamped with the slot it fell in, so the caller's wait has no slot in it at all. (The receiver
plays a packet at its timestamp, so an early send with a later timestamp would gain nothing; a packet up to 10 ms
behind its timestamp is jitter its buffer absorbs, as for a late frame mid-answer below.) The higher packet rate
lasts only as long as the engine takes to its first frame. Once an answer's audio has been sent (or cut), one more 80 ms
packet of zeros flushes the encoder's look-ahead, so the answer's last milliseconds are heard and the next
answer starts from silence.

Mid-answer, a frame that is not ready at its moment gets up to `LATE_GRACE_S` more before its slot goes out as
80 ms of zeros: a frame a little late (an engine at about real time on a busy CPU, the first frames of an answer
before it has any lead) then reaches the caller as network jitter of that size does, which the receiver's
jitter buffer absorbs, instead of as a hole of 80 ms. Its RTP timestamp is its slot's, and the packets after it
keep the schedule.
"""
from __future__ import annotations

import asyncio
import collections
import fractions
import functools
import time

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

SAMPLE_RATE = 24_000  # what the engine speaks
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz
RTP_RATE = 48_000
PACKET_STEP = 3840  # 80 ms at 48 kHz
IDLE_STEP = 960  # 20 ms at 48 kHz: a silence packet between answers
AWAIT_STEP = 480  # 10 ms at 48 kHz: a silence packet while an answer's first frame is on its way
AWAIT_S = AWAIT_STEP / RTP_RATE  # how long such a slot waits for the first frame before its silence goes out
PACKET_S = FRAME_SAMPLES / SAMPLE_RATE
RTP_TIME_BASE = fractions.Fraction(1, RTP_RATE)
MAX_LAG_S = 0.25  # further behind than this (the event loop stalled): restart the clock instead of bursting
LATE_GRACE_S = 0.04  # how long a mid-answer frame may be late before its slot goes out as a gap


class Playout:
    """One answer's audio on its way out, and what happened to it."""

    def __init__(self, speech: bool = True) -> None:
        self.speech = speech  # False: a written answer, which sends no frames
        self._frames: collections.deque[np.ndarray] = collections.deque()
        self._finished = False
        self._gap = False  # a silence packet went out mid-answer: the next frame is late
        self.done = asyncio.Event()
        self._changed = asyncio.Event()  # a frame was queued, or the answer finished
        self.frames_made = 0
        self.frames_sent = 0
        self.frames_late = 0  # sent after a silence packet filled its slot: ready more than LATE_GRACE_S after it
        self.frames_dropped = 0  # never sent: the answer was interrupted
        self.first_packet_at: float | None = None  # time.monotonic() when the first frame was handed to RTP
        self.interrupted = False

    def push(self, samples: np.ndarray) -> None:
        """Queues one frame: FRAME_SAMPLES float32 samples at 24 kHz."""
        if self.done.is_set():
            return
        if samples.shape != (FRAME_SAMPLES,):
            raise ValueError(f"a speech frame is {FRAME_SAMPLES} samples, got shape {samples.shape}")
        self._frames.append(np.asarray(samples, np.float32))
        self.frames_made += 1
        self._changed.set()

    def finish(self) -> None:
        """No more frames will come; `done` is set once the queued ones are sent."""
        self._finished = True
        self._changed.set()
        if not self._frames:
            self.done.set()

    def interrupt(self) -> int:
        """Drops the frames not sent yet; returns how many frames were sent."""
        self.frames_dropped += len(self._frames)
        self._frames.clear()
        self.interrupted = True
        self._finished = True
        self._changed.set()
        self.done.set()
        return self.frames_sent

    @property
    def queued(self) -> int:
        return len(self._frames)

    @property
    def awaiting_first_frame(self) -> bool:
        """A spoken answer whose first frame has not been sent yet and is still to come."""
        return self.speech and self.first_packet_at is None and not self._finished

    async def wait_for_frame(self, timeout_s: float) -> None:
        """With no frame queued while one is to come (mid-answer, or a spoken answer's first): wait up to
        `timeout_s` for it (or the answer's end)."""
        deadline = time.monotonic() + timeout_s
        while (self.first_packet_at is not None or self.speech) and not self._frames and not self._finished:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return

    async def changed(self) -> None:
        """Waits until a frame is queued or the answer finishes (for a consumer that is not clocked)."""
        await self._changed.wait()
        self._changed.clear()

    def take(self) -> np.ndarray | None:
        """The next frame, counted as sent; None when none is queued (mid-answer, the next one will be late)."""
        if self._frames:
            frame = self._frames.popleft()
            self.frames_sent += 1
            if self.first_packet_at is None:
                self.first_packet_at = time.monotonic()
            if self._gap:
                self.frames_late += 1
                self._gap = False
            if self._finished and not self._frames:
                self.done.set()
            return frame
        if self.first_packet_at is not None and not self._finished:
            self._gap = True
        return None


class OpusEncoder:
    """PyAV libopus, mono, 24 kHz in, one packet out per call (80 ms frames unless told otherwise)."""

    def __init__(self, bitrate: int = 32_000, frame_ms: int = 80) -> None:
        codec = av.CodecContext.create("libopus", "w")
        codec.sample_rate = SAMPLE_RATE
        codec.layout = "mono"
        codec.format = "flt"
        codec.bit_rate = bitrate
        codec.time_base = fractions.Fraction(1, SAMPLE_RATE)
        codec.options = {"frame_duration": str(frame_ms), "application": "voip"}
        codec.open()
        self._codec = codec
        self._pts = 0

    def encode(self, samples: np.ndarray) -> av.Packet:
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.pts = self._pts
        self._pts += len(samples)
        packets = self._codec.encode(frame)
        if len(packets) != 1:  # libopus emits one packet per full frame, at once
            raise RuntimeError(f"libopus returned {len(packets)} packets for one frame")
        return packets[0]


@functools.cache
def silence_packets() -> dict[int, bytes]:
    """RTP step -> a pre-encoded silence packet of that length, made once a process. The server makes them at
    start-up (`warm_up_media`): a process's first Opus encode took 16-23 ms on the H200 host, and inside a
    caller's connect it held up every call of the process for that long."""
    return {IDLE_STEP: _silence_packet(20), AWAIT_STEP: _silence_packet(10)}


def _silence_packet(frame_ms: int) -> bytes:
    """An Opus packet of `frame_ms` of silence, as a settled encoder makes it."""
    encoder, silence = OpusEncoder(frame_ms=frame_ms), np.zeros(SAMPLE_RATE * frame_ms // 1000, np.float32)
    for _ in range(4):
        encoder.encode(silence)
    return bytes(encoder.encode(silence))


class AnswerOutput:
    """Where a call's answers go: one Playout at a time; a new answer or a barge-in ends the one before."""

    def __init__(self) -> None:
        self._playout: Playout | None = None

    def start_playout(self, speech: bool = True) -> Playout:
        """A new answer (`speech` False: a written one); whatever was still queued from an earlier one is dropped."""
        if self._playout is not None and not self._playout.done.is_set():
            self._playout.interrupt()
        self._playout = Playout(speech)
        self._started()
        return self._playout

    def interrupt(self) -> Playout | None:
        """Barge-in: stops the current answer before its next packet. Returns it (None when idle)."""
        playout, self._playout = self._playout, None
        if playout is not None and not playout.done.is_set():
            playout.interrupt()
            return playout
        return None

    def _started(self) -> None:
        """A new playout is current (a hook for outputs that wait for one)."""


class OutboundAudioTrack(AnswerOutput, MediaStreamTrack):
    """An audio track whose recv() hands aiortc one pre-encoded Opus packet at a time, in real time:
    80 ms packets while an answer plays, 20 ms silence packets between answers (10 ms ones while an answer's
    first frame is awaited)."""

    kind = "audio"

    def __init__(self) -> None:
        AnswerOutput.__init__(self)
        MediaStreamTrack.__init__(self)
        self._encoder = OpusEncoder()
        self._zeros = np.zeros(FRAME_SAMPLES, np.float32)
        self._speaking = False  # 80 ms packets: from an answer's first frame to the flush after its last
        self._start: float | None = None
        self._pts = 0  # RTP timestamp of the next packet
        self.packets_sent = 0

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        due = self._start + self._pts / RTP_RATE
        if due > now:
            await asyncio.sleep(due - now)
        elif now - due > MAX_LAG_S:  # the loop stalled: carry on from now rather than catch up in a burst
            self._start = now - self._pts / RTP_RATE
        if self._playout is not None:
            await self._playout.wait_for_frame(AWAIT_S if self._playout.awaiting_first_frame else LATE_GRACE_S)
        frame = self._take()
        if frame is not None:
            packet, step = self._encoder.encode(frame), PACKET_STEP
        else:
            awaiting = self._playout is not None and self._playout.awaiting_first_frame
            step = AWAIT_STEP if awaiting else IDLE_STEP
            packet = av.Packet(silence_packets()[step])
        packet.pts = self._pts
        packet.time_base = RTP_TIME_BASE
        self._pts += step
        self.packets_sent += 1
        return packet

    def _take(self) -> np.ndarray | None:
        """The next 80 ms of answer audio (zeros for a gap or the final flush), or None: an idle packet."""
        playout = self._playout
        frame = playout.take() if playout is not None else None
        if playout is not None and playout.done.is_set():
            self._playout = None
        if frame is not None:
            self._speaking = True
            return frame
        if self._speaking:
            self._speaking = playout is not None  # still mid-answer: a gap; else this is the flush
            return self._zeros
        return None
