"""The engine's asyncio face: one `Engine` per process, one `Session` per call.

All torch work runs on a single worker thread per device, so the event loop never blocks and the model is never
used from two threads. Each session step (a prefill chunk, one 80 ms frame) is one job on that thread; sessions
interleave frame by frame. The worker is the one place that sees every session's next step, which is where
batching several sessions into one decode step belongs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from . import attention, audio_input, moe, norm, rotary, vision_input
from .conversation import Conversation, TokenIds
from .events import INPUT_SAMPLE_RATE, Event, ResponseDone, SpeechFrame
from .loader import LoadedModel, load
from .options import EngineOptions, SessionOptions

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(self, loaded: LoadedModel, options: EngineOptions) -> None:
        self.loaded = loaded
        self.options = options
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.feature_extractor = loaded.feature_extractor
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.speech = not options.text_only
        self.cuda_graphs = options.cuda_graphs and self.device.type == "cuda"
        moe.install(self.model, enabled=options.fast_moe and self.device.type == "cuda")
        attention.install(self.model, enabled=options.fast_attention and self.device.type == "cuda")
        norm.install(self.model, enabled=options.fast_norm and self.device.type == "cuda")
        rotary.install(self.model, enabled=options.fast_rotary and self.device.type == "cuda")
        self.ids = TokenIds.from_model(self.model, self.tokenizer)
        self.ready = False
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rtc-agent-{self.device}")
        self.tts: dict[str, torch.Tensor] = {}
        if self.speech:
            with torch.inference_mode():
                special = torch.tensor([[self.ids.tts_bos, self.ids.tts_eos, self.ids.tts_pad]], device=self.device)
                bos, eos, pad = self.project_text(self.model.thinker.get_input_embeddings()(special)).chunk(3, dim=1)
            self.tts = {"bos": bos, "eos": eos, "pad": pad}

    @classmethod
    def load(cls, options: EngineOptions = EngineOptions()) -> "Engine":
        """Load the model (blocking: seconds for `tiny`, minutes for a real checkpoint)."""
        return cls(load(options.model, options.device, options.text_only, options.dtype), options)

    def describe(self) -> dict[str, Any]:
        return {"model": self.loaded.name, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "speech": self.speech, "streaming": self.options.streaming, "ready": self.ready,
                "prefill_chunk_s": self.options.prefill_chunk_s, "context_tokens": self.options.context_tokens,
                "video_window_s": self.options.video_window_s}

    def gpu_peak_gb(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 1e9

    def project_text(self, embeds: torch.Tensor) -> torch.Tensor:
        """Thinker token embeddings → the Talker's text input (`text_projection`)."""
        return self.model.talker.text_projection(embeds)

    def speaker_id(self, voice: str) -> int:
        return self.model.config.talker_config.speaker_id[voice]

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` on the worker thread, under inference mode."""
        def job() -> T:
            with torch.inference_mode():
                return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._worker, job)

    def new_session(self, options: SessionOptions = SessionOptions()) -> "Session":
        return Session(self, options)

    async def warmup(self) -> None:
        """Run one short turn end to end so the first caller pays no first-use costs; then `ready` is True.

        The turn samples as callers do (their draws' kernels are loaded on first use, milliseconds on a GPU) and is
        a prefill chunk plus a tail, the two ways caller audio reaches the Thinker."""
        started = time.perf_counter()
        session = self.new_session(SessionOptions(seed=0, max_answer_tokens=4, max_frames=4))
        await session.push_audio(np.zeros(int(INPUT_SAMPLE_RATE * 1.37), dtype=np.float32))
        async for _ in session.respond():
            pass
        await session.close()
        self.ready = True
        log.info("engine warmed up in %.1f s", time.perf_counter() - started)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


class Session:
    """One caller's conversation. Methods are coroutines; none of them blocks the event loop."""

    def __init__(self, engine: Engine, options: SessionOptions) -> None:
        self.engine = engine
        self.options = self._resolve(options)
        self._conversation: Conversation | None = None
        self._answering = False
        self._buffered: list[tuple[np.ndarray, float | None]] = []  # audio pushed while an answer is being made
        self._interrupt: int | None = None
        self.closed = False

    def _resolve(self, options: SessionOptions) -> SessionOptions:
        eo = self.engine.options
        tokens = min(options.max_answer_tokens or eo.max_answer_tokens, eo.max_answer_tokens)
        frames = min(options.max_frames or eo.max_frames, eo.max_frames)
        return replace(options, max_answer_tokens=tokens, max_frames=frames)

    def update(self, **changes: Any) -> None:
        """Change voice, instructions or sampling; they apply from the next turn on."""
        self.options = self._resolve(replace(self.options, **changes))

    async def _conv(self) -> Conversation:
        if self._conversation is None:
            self._conversation = await self.engine.run(Conversation, self.engine, self.options)
        elif self._conversation.options is not self.options:
            await self.engine.run(self._conversation.apply, self.options)
        return self._conversation

    async def push_audio(self, samples: np.ndarray, sample_rate: int = INPUT_SAMPLE_RATE,
                         at: float | None = None) -> None:
        """Caller audio as it arrives: mono float32 at 16 kHz. Prefills in the background every chunk.

        `at` is the time of the first sample on the session's media clock (seconds), the clock `push_image`
        uses; None means right after the previous push. Only calls with video need it."""
        self._check_open()
        if sample_rate != INPUT_SAMPLE_RATE:
            raise ValueError(f"audio must be {INPUT_SAMPLE_RATE} Hz, got {sample_rate} Hz: resample it first")
        samples = audio_input.check_samples(samples)
        at = _check_time(at) if at is not None else None
        if self._answering:
            self._buffered.append((samples, at))
            return
        conv = await self._conv()
        await self.engine.run(conv.add_audio, samples, at)

    async def push_text(self, text: str) -> None:
        """Text the caller typed (a chat message): it joins the caller's turn after its audio, or is the whole
        turn; `respond()` answers it. ValueError for text that is empty once tokenized."""
        self._check_open()
        if not isinstance(text, str):
            raise ValueError("text must be a string")
        if self._answering:
            raise RuntimeError("an answer is in progress on this session: push text after it")
        conv = await self._conv()
        await self.engine.run(conv.add_text, text)

    async def push_image(self, image: np.ndarray, at: float) -> None:
        """One caller video frame: RGB uint8 [H, W, 3] captured at `at` seconds on the media clock. Frames wait
        until the turn of their moment (the last `video_window_s` seconds of them); sides are rounded to multiples
        of 32 pixels. About 2 frames a second is what the model reads."""
        self._check_open()
        image = vision_input.check_image(image)
        at = _check_time(at)
        conv = await self._conv()
        await self.engine.run(conv.add_image, image, at)

    def video_stats(self) -> dict[str, Any]:
        """What became of the caller's video: frames received, seconds of video in the context."""
        conv = self._conversation
        if conv is None:
            return {"frames_received": 0, "last_at": None, "seconds_in_context": 0, "tokens_in_context": 0}
        segments = [*conv.segments, *([conv.turn.segment] if conv.turn is not None else [])]
        grids = [g for s in segments for g in s.grids]
        return {"frames_received": conv.video.received, "last_at": conv.video.last_at,
                "seconds_in_context": len(grids), "tokens_in_context": sum(g.tokens for g in grids)}

    async def abort_turn(self) -> None:
        """Forget the caller audio pushed since the last answer (a false start)."""
        self._check_open()
        self._buffered.clear()
        if self._conversation is not None:
            await self.engine.run(self._conversation.abort_turn)

    async def respond(self) -> AsyncIterator[Event]:
        """End the caller's turn and stream the answer: TextDelta and SpeechFrame events, then one ResponseDone."""
        self._check_open()
        if self._answering:
            raise RuntimeError("an answer is already in progress on this session")
        conv = await self._conv()
        if not conv.has_audio() and not conv.typed:
            raise ValueError("no caller audio or text in this turn: push at least 10 ms of audio, or text, before "
                             "asking for an answer")
        self._answering = True
        self._interrupt = None
        steps = conv.answer()
        try:
            if not self.engine.options.streaming:  # the whole answer, then its audio
                events = await self.engine.run(list, steps)
                for event in sorted(events, key=lambda e: 2 if isinstance(e, ResponseDone) else isinstance(e, SpeechFrame)):
                    yield event
                return
            while True:
                if self._interrupt is not None:
                    conv.interrupt(self._interrupt)
                event = await self.engine.run(next, steps, None)
                if event is None:
                    return
                yield event
                if isinstance(event, ResponseDone):
                    return
        finally:
            await self.engine.run(steps.close)
            self._answering = False
            buffered, self._buffered = self._buffered, []
            for samples, at in buffered:
                await self.engine.run(conv.add_audio, samples, at)

    async def cancel(self, frames_played: int | None = None) -> None:
        """Barge-in: stop the answer within one frame. `frames_played` is how many frames the caller heard (the
        history keeps only their text); None keeps everything made so far. After `respond()` has finished (the
        answer was made faster than it was played), the history of the latest answer is trimmed the same way."""
        if self._answering:
            self._interrupt = frames_played if frames_played is not None else 1 << 30
        elif frames_played is not None and self._conversation is not None and not self.closed:
            await self.engine.run(self._conversation.trim_last_answer, frames_played)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._interrupt = 0
        self._conversation = None  # caches are freed with it

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this session is closed")


def _check_time(at: float) -> float:
    if not isinstance(at, (int, float)) or not np.isfinite(at) or at < 0:
        raise ValueError(f"a media-clock time must be a finite number of seconds >= 0, got {at!r}")
    return float(at)
