"""The engine's asyncio face: one `Engine` per process, one `Session` per call.

All torch work runs on a single worker thread per device (`worker.py`), so the event loop never blocks and the
model is never used from two threads. At start-up the engine makes its session slots (`slots.py`: caches and
CUDA graphs for `max_sessions` calls); a session takes a free slot and gives it back when it closes. The worker
runs the sessions' prefills as jobs and advances every answer in progress with one batched step per frame.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from ..errors import EngineFullError
from ..events import INPUT_SAMPLE_RATE, Event, ResponseDone, SpeechFrame
from ..model.kernels import attention, moe, norm, rotary
from ..model.loader import LoadedModel, load
from ..model.memory import EngineOutOfMemory, MemoryUse, read_memory
from ..model.token_ids import TokenIds
from ..options import EngineOptions, SessionOptions
from ..scheduler.policy import NORMAL, REQUEST_STAGES, URGENT
from ..scheduler.slots import Slot, SlotPool, estimated_slot_bytes, slot_count
from ..scheduler.stages import StageRunner
from ..scheduler.worker import Worker
from ..step import audio_input, vision_input
from ..step.answer import Answer, tick
from ..step.graphs import batch_sizes
from ..step.talker_inputs import TalkerInputs
from ..step.tools import ToolRuntime
from ..step.turn_scoring import TurnScoring, end_of_turn_mode
from .context import CallContext

log = logging.getLogger(__name__)
T = TypeVar("T")
WARM_CAMERA = (288, 384)  # height, width: 640x480 scaled to fit the server's default video_max_side (384)


class Engine:
    def __init__(self, loaded: LoadedModel, options: EngineOptions) -> None:
        self.loaded = loaded
        self.options = options
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.feature_extractor = loaded.feature_extractor
        self.log_mel = audio_input.LogMel(loaded.feature_extractor, loaded.device)
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.speech = not options.text_only
        self.cuda_graphs = options.cuda_graphs and self.device.type == "cuda"
        self.first_frame_in_preparation = (self.device.type == "cuda" if options.first_frame_in_preparation is None
                                           else options.first_frame_in_preparation)
        moe.install(self.model, enabled=options.fast_moe and self.device.type == "cuda")
        attention.install(self.model, enabled=options.fast_attention and self.device.type == "cuda")
        norm.install(self.model, enabled=options.fast_norm and self.device.type == "cuda")
        rotary.install(self.model, enabled=options.fast_rotary and self.device.type == "cuda")
        self.ids = TokenIds.from_model(self.model, self.tokenizer)
        self.tool_runtime = ToolRuntime.for_tokenizer(self.tokenizer, self.model.thinker.lm_head.out_features,
                                                      self.ids.im_end)
        self.ready = False
        self.end_of_turn = end_of_turn_mode(options.end_of_turn, self.device)
        self.turn_scoring: TurnScoring | None = None  # Smart Turn on this device, once warm (score_turn)
        with torch.inference_mode():
            self.talker_inputs = TalkerInputs(self.model, self.ids, self.device) if self.speech else None
            started = time.perf_counter()
            self.pool = SlotPool(self, slot_count(self, options.max_sessions))
            defaults = SessionOptions()
            self.pool.capture(defaults.talker_sampling, defaults.predictor_sampling)
            self.audio_encoder = audio_input.AudioEncoder(self.model.thinker.model.audio_tower, self.cuda_graphs)
        log.info("%d session slots ready in %.1f s", len(self.pool), time.perf_counter() - started)
        # (a GPU engine's worker thread runs only small CPU ops: inputs to copy over; with torch's default of one
        # thread per core, a second of log-mel, then made on the CPU, took 12.9 ms P90 instead of 0.75 ms while 12
        # other busy processes shared the cores, H200 machine)
        self.run_stage = StageRunner(self.pool, lambda stretches: self.audio_encoder(self.log_mel.many(stretches)))
        self._worker = Worker(f"rtc-agent-{self.device}", lambda answers: tick(self.pool, answers), self.run_stage,
                              lambda request: REQUEST_STAGES.index(type(request)), threads=options.cpu_threads)

    @classmethod
    def load(cls, options: EngineOptions = EngineOptions()) -> "Engine":
        """Load the model (blocking: seconds for `tiny`, minutes for a real checkpoint)."""
        return cls(load(options.model, options.device, options.text_only, options.dtype, options.quantize,
                        reserve_bytes=max(1, options.max_sessions) * int(estimated_slot_bytes(options))
                        if options.quantize == "auto" else 0, memory_fraction=options.gpu_memory_fraction), options)

    def describe(self) -> dict[str, Any]:
        return {"model": self.loaded.name, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "quantize": self.loaded.quantize,
                "speech": self.speech, "streaming": self.options.streaming, "ready": self.ready,
                "max_sessions": len(self.pool), "free_sessions": self.pool.free,
                "prefill_chunk_s": self.options.prefill_chunk_s, "context_tokens": self.options.context_tokens,
                "video_window_s": self.options.video_window_s,
                "end_of_turn": self.end_of_turn if self.turn_scoring is not None else "media"}

    def gpu_peak_gb(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 1e9

    def memory(self) -> MemoryUse | None:
        """GPU memory in use now (memory.py says what counts); None on a CPU."""
        return read_memory(self.device)

    async def run(self, fn: Callable[..., T], *args, urgent: bool = False, key: Any = None) -> T:
        """Run `fn(*args)` on the worker thread, under inference mode; `urgent` jobs go first. `key`: the session
        slot it works on (its jobs keep their order; a generator `fn` may be batched with other slots' prefills)."""
        priority = URGENT if urgent else NORMAL
        def call() -> T:
            return fn(*args)

        call.__name__ = getattr(fn, "__name__", "?")  # (what the worker trace calls the job)
        return await asyncio.wrap_future(self._worker.submit(call, priority, key))

    def new_session(self, options: SessionOptions = SessionOptions()) -> "Session":
        """A session on a free slot; `EngineFullError` when every slot is taken."""
        return Session(self, options)

    async def open_session(self, options: SessionOptions = SessionOptions()) -> "Session":
        """`new_session` as the server asks for one: the same call for this engine and for one in another process
        (remote.RemoteEngine)."""
        return self.new_session(options)

    def release(self, slot: Slot) -> None:
        """Give `slot` back once its answer in progress, if any, is over (on the worker)."""
        answer = slot.answer
        if answer is not None and not answer.done:
            answer.interrupt(0)
            answer.after.append(lambda: self.pool.release(slot))
        else:
            self.pool.release(slot)

    @property
    def worker_thread_id(self) -> int | None:
        """The worker thread's id in the operating system (its CPU time: /proc/self/task/ID/stat)."""
        return self._worker.thread_id

    def add_answer(self, answer: Answer) -> None:
        self._worker.add(answer)

    async def warmup(self) -> None:
        """Run short turns end to end so that no caller pays a first-use cost; then `ready` is True.

        First one turn, then the turns of 2, 4, ... and every slot ending at once (the batch sizes the steps are
        captured for): their audio and preparations go through each stage of a round together, as a burst of
        callers' do, so that the draws and the eager work around the graphs meet each width before a caller's does
        (on the H200 the first draw of 4 rows' first tokens took 24 ms of host time here, the callers' draws of
        11-24 rows after it 5-15 ms; the old warm-up of one turn left such costs to the first callers). A turn
        samples as callers do (their draws' kernels are loaded on first use, milliseconds on a GPU) and is a
        prefill chunk, a flush, a tail and a prepared answer, the ways caller audio reaches the Thinker and answers
        start."""
        started = time.perf_counter()
        for rows in batch_sizes(len(self.pool)):
            await self._warm_turns(rows)
        if self.options.video_window_s:
            await self._warm_camera()
        if self.end_of_turn != "media":  # (after the graphs' captures: its thread runs beside the worker's)
            self.turn_scoring = await asyncio.to_thread(TurnScoring.load, self.device)
        self.ready = True
        log.info("engine warmed up in %.1f s", time.perf_counter() - started)

    async def _warm_turns(self, rows: int) -> None:
        """`rows` sessions' turns, each step of them (audio chunk, flush, the answer's preparation) in one round for
        all, then their answers together."""
        sessions = [self.new_session(SessionOptions(seed=0, max_answer_tokens=4, max_frames=4)) for _ in range(rows)]

        async def together(work: Callable[[Session], Awaitable[Any]]) -> None:
            with self._worker.held():  # every session's job queued before any starts
                tasks = [asyncio.ensure_future(work(session)) for session in sessions]
                await asyncio.sleep(0)  # (each queues its job at its first step)
            await asyncio.gather(*tasks)

        try:
            await together(Session._ready_context)
            await together(lambda s: s.push_audio(np.zeros(int(INPUT_SAMPLE_RATE * 1.37), dtype=np.float32), at=0.0))
            await together(Session.flush)  # a pause: the audio encoder on a piece shorter than a chunk, as calls have
            await together(lambda s: s.push_audio(np.zeros(int(INPUT_SAMPLE_RATE * 0.29), dtype=np.float32)))
            await together(Session.prepare_answer)
            await asyncio.gather(*(_drain(session.respond()) for session in sessions))
        finally:
            for session in sessions:
                await session.close()

    async def _warm_camera(self) -> None:
        """A camera call's first two turns, its frames at a 4:3 camera's size at the server's default
        (WARM_CAMERA): the vision encoder at that size, a turn's prefill with video, and the second turn's opening
        with the seconds that came during the first answer, longer than a graphed prefill (so eager). Without them
        the first camera call after a start waited 645-1150 ms (server first packet) for its second answer on the
        H200, later camera calls 27-48 ms. The frames differ from each other: a still second is left out."""
        session = self.new_session(SessionOptions(seed=0, max_answer_tokens=4, max_frames=4))
        frames = np.random.default_rng(0).integers(0, 256, (12, *WARM_CAMERA, 3), dtype=np.uint8)
        try:
            for n in range(4):
                await session.push_image(frames[n], 0.5 * n)
            await session.push_audio(np.zeros(INPUT_SAMPLE_RATE * 2, dtype=np.float32), at=0.0)
            await _drain(session.respond())
            for n in range(4, len(frames)):
                await session.push_image(frames[n], 0.5 * n)
            await session.push_audio(np.zeros(INPUT_SAMPLE_RATE, dtype=np.float32), at=0.5 * len(frames))
            await _drain(session.respond())
        finally:
            await session.close()

    async def score_turn(self, audio: np.ndarray) -> tuple[float, float]:
        """Smart Turn's P(turn complete) for a turn's audio (16 kHz), and the milliseconds its batch took; only
        where describe()["end_of_turn"] is "engine" or "overflow"."""
        if self.turn_scoring is None:
            raise RuntimeError("this engine does not score turns (end_of_turn: media)")
        return await self.turn_scoring.score(audio)

    def close(self) -> None:
        if self.turn_scoring is not None:
            self.turn_scoring.close()
        self._worker.close()


class Session:
    """One caller's conversation on one slot. Methods are coroutines; none of them blocks the event loop."""

    def __init__(self, engine: Engine, options: SessionOptions) -> None:
        self.engine = engine
        self.options = self._resolve(options)
        slot = engine.pool.acquire()
        if slot is None:
            raise EngineFullError(f"all {len(engine.pool)} session slots are taken")
        self._slot = slot
        self._context: CallContext | None = None
        self._making: asyncio.Task[CallContext] | None = None  # the context being made (the call's first input)
        self._answer: Answer | None = None
        self._answering = False  # from respond() until its answer is over
        self._buffered: list[tuple[np.ndarray, float | None]] = []  # audio pushed while an answer is being made
        self._interrupt: int | None = None  # a cancel that came before the answer started
        self.closed = False
        # A session dropped without close() still gives its slot back.
        self._release = weakref.finalize(self, _release_later, engine, slot)

    def _resolve(self, options: SessionOptions) -> SessionOptions:
        eo = self.engine.options
        tokens = min(options.max_answer_tokens or eo.max_answer_tokens, eo.max_answer_tokens)
        frames = min(options.max_frames or eo.max_frames, eo.max_frames)
        if options.tools.tools and self.engine.tool_runtime is None:
            raise ValueError("this model's tokenizer has no <tool_call> token: it cannot call functions")
        if options.language is not None and self.engine.tool_runtime is None:
            raise ValueError("this model's tokenizer has no <tool_call> token: the language lock is not built for it")
        return replace(options, max_answer_tokens=tokens, max_frames=frames)

    def update(self, **changes: Any) -> None:
        """Change voice, instructions or sampling; they apply from the next turn on."""
        self.options = self._resolve(replace(self.options, **changes))

    @property
    def context(self) -> CallContext | None:
        """This call's model-side state, once its first input came (the bench and the GPU checks read it)."""
        return self._context

    async def _ready_context(self) -> CallContext:
        if self._context is None:
            # Calls that come while it is being made wait for the same one, and then queue their work in the
            # order they came (the media side does not wait for one call's reply before the next).
            if self._making is None:
                self._making = asyncio.ensure_future(self._run(CallContext, self.engine, self._slot, self.options))
            making = self._making
            try:
                self._context = await asyncio.shield(making)  # (a caller that gives up leaves it to the others)
            except Exception:
                if self._making is making:  # the next call tries again
                    self._making = None
                raise
        elif self._context.options is not self.options:
            await self._run_turn(self._context.apply, self.options)
        return self._context

    async def _made_context(self) -> CallContext | None:
        """The context, or None if no input has come yet (nothing to change)."""
        if self._context is None and self._making is None:
            return None
        return await self._ready_context()

    async def _run(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        """Run `fn(*args)` on the worker, in order with this call's other work."""
        return await self.engine.run(fn, *args, urgent=urgent, key=self._slot.index)

    async def _run_turn(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        """Run a piece of this call's work on the worker (`fn` may be a generator of `CallContext`'s, its prefills
        batched with other calls'). If the GPU runs out of memory in it, the caller's turn is dropped, the caches
        are left consistent, and `EngineOutOfMemory` says so: the call goes on."""
        context = self._context

        def job():
            try:
                result = fn(*args)
                if inspect.isgenerator(result):
                    result = yield from result
                return result
            except torch.OutOfMemoryError:
                log.warning("out of GPU memory in %s; the caller's turn is dropped", getattr(fn, "__name__", fn))
                context.recover()
                raise EngineOutOfMemory("the GPU ran out of memory for this turn; it was dropped (the call goes "
                                        "on: speak again)") from None

        job.__name__ = getattr(fn, "__name__", "job")  # (what the worker trace calls the job)
        return await self._run(job, urgent=urgent)

    async def limit_video(self, window_s: int) -> int | None:
        """Keep at most `window_s` seconds of the caller's video in the context (the memory guard); returns the
        window now in force, None when this call has sent no video."""
        if self.closed or (context := await self._made_context()) is None:
            return None
        return await self._run(context.limit_video, window_s)

    async def push_audio(self, samples: np.ndarray, sample_rate: int = INPUT_SAMPLE_RATE,
                         at: float | None = None, urgent: bool = False) -> None:
        """Caller audio as it arrives: mono float32 at 16 kHz. Prefills in the background every chunk.

        `at` is the time of the first sample on the session's media clock (seconds), the clock `push_image`
        uses; None means right after the previous push. Only calls with video need it. `urgent`: the caller has
        paused and `prepare_answer` comes next, so this audio goes before other calls' ordinary work, as the
        preparation will (else a preparation waits for its own caller's last audio at the back of the queue)."""
        self._check_open()
        if sample_rate != INPUT_SAMPLE_RATE:
            raise ValueError(f"audio must be {INPUT_SAMPLE_RATE} Hz, got {sample_rate} Hz: resample it first")
        samples = audio_input.check_samples(samples)
        at = _check_time(at) if at is not None else None
        if self._answering:
            self._buffered.append((samples, at))
            return
        context = await self._ready_context()
        await self._run_turn(context.add_audio, samples, at, urgent=urgent)

    async def push_text(self, text: str) -> None:
        """Text the caller typed (a chat message): it joins the caller's turn after its audio, or is the whole
        turn; `respond()` answers it. ValueError for text that is empty once tokenized."""
        await self._push_written("text", text, lambda context: context.add_text)

    async def push_tool_output(self, output: str) -> None:
        """What a function the answer called returned (`ToolCallDone`): it joins the caller's turn as the model's
        chat template gives a tool's response, after anything else in the turn; `respond()` goes on from it."""
        await self._push_written("a tool's output", output, lambda context: context.add_tool_output)

    async def _push_written(self, what: str, value: str, add: Callable[[CallContext], Callable[[str], None]]) -> None:
        """`value` (a string) into the caller's turn through `add(context)`; not while an answer is being made."""
        self._check_open()
        if not isinstance(value, str):
            raise ValueError(f"{what} must be a string")
        if self._answering:
            raise RuntimeError(f"an answer is in progress on this session: push {what} after it")
        context = await self._ready_context()
        await self._run(add(context), value)

    async def flush(self) -> None:
        """The caller paused: prefill the audio pushed so far now rather than at the end of the turn (which then
        has only what comes after to encode). No effect during an answer."""
        self._check_open()
        if (context := await self._made_context()) is not None and not self._answering:
            await self._run_turn(context.flush)

    async def prepare_answer(self) -> None:
        """The caller paused and may be done (a call server's hang-over has begun): prefill the turn and make its
        answer ready, so that `respond()` at the turn's end starts speaking at once. Audio pushed after this is the
        turn's trailing silence: push it only if the caller speaks again (a push, text or an abort undoes the
        preparation first); video frames can still be pushed. No effect during an answer."""
        self._check_open()
        if (context := await self._made_context()) is not None and not self._answering:
            await self._run_turn(context.prepare_answer, urgent=True)

    async def push_image(self, image: np.ndarray, at: float) -> None:
        """One caller video frame: RGB uint8 [H, W, 3] captured at `at` seconds on the media clock. Frames wait
        until the turn of their moment (the last `video_window_s` seconds of them); sides are rounded to multiples
        of 32 pixels. About 2 frames a second is what the model reads."""
        self._check_open()
        image = vision_input.check_image(image)
        at = _check_time(at)
        context = await self._ready_context()
        await self._run(context.add_image, image, at)

    def video_stats(self) -> dict[str, Any]:
        """What became of the caller's video: frames received, seconds of video in the context."""
        context = self._context
        if context is None:
            return {"frames_received": 0, "last_at": None, "seconds_in_context": 0, "tokens_in_context": 0,
                    "window_s": self.engine.options.video_window_s}
        segments = [*context.segments, *([context.turn.segment] if context.turn is not None else [])]
        grids = [g for s in segments for g in s.grids]
        return {"frames_received": context.video.received, "last_at": context.video.last_at,
                "seconds_in_context": len(grids), "tokens_in_context": sum(g.tokens for g in grids),
                "window_s": context.video.window_s}

    async def abort_turn(self) -> None:
        """Forget the caller audio pushed since the last answer (a false start)."""
        self._check_open()
        self._buffered.clear()
        if (context := await self._made_context()) is not None:
            await self._run_turn(context.abort_turn)

    async def respond(self) -> AsyncIterator[Event]:
        """End the caller's turn and stream the answer: TextDelta and SpeechFrame events, then one ResponseDone."""
        self._check_open()
        if self._answering:
            raise RuntimeError("an answer is already in progress on this session")
        context = await self._ready_context()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event | Exception] = asyncio.Queue()
        self._interrupt = None
        self._answering = True
        asked_at = time.perf_counter()

        def start():  # (the turn is read on the worker: its preparation may still be running there)
            if not context.has_audio() and not context.typed:
                raise ValueError("no caller audio or text in this turn: push at least 10 ms of audio, or text, "
                                 "before asking for an answer")
            answer = yield from context.begin_answer(lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                                                  asked_at)
            self.engine.add_answer(answer)
            return answer

        try:
            self._answer = await self._run_turn(start, urgent=True)
        except BaseException:
            self._answering = False
            raise
        try:
            if self._interrupt is not None:  # a cut that came while the answer was starting
                self._answer.interrupt(self._interrupt)
            held: list[Event] = []  # not streaming: the whole answer, then its events
            while True:
                event = await events.get()
                if isinstance(event, Exception):
                    raise event
                if self._interrupt is not None and not isinstance(event, ResponseDone):
                    continue  # made ahead of the cut (the worker runs ahead of playout): never heard
                if self.engine.options.streaming:
                    yield event
                else:
                    held.append(event)
                if isinstance(event, ResponseDone):
                    break
            for event in sorted(held, key=lambda e: 2 if isinstance(e, ResponseDone) else isinstance(e, SpeechFrame)):
                yield event
        finally:
            answer, self._answer = self._answer, None
            self._answering = False
            if not answer.done:  # the caller stopped listening: cut the answer, keep what was made
                answer.interrupt(1 << 30)
                while not isinstance(event := await events.get(), (ResponseDone, Exception)):
                    pass
            buffered, self._buffered = self._buffered, []
            for samples, at in buffered:
                await self._run_turn(context.add_audio, samples, at)

    async def cancel(self, frames_played: int | None = None) -> None:
        """Barge-in: stop the answer within one frame. `frames_played` is how many frames the caller heard (the
        history keeps only their text); None keeps everything made so far. After `respond()` has finished (the
        answer was made faster than it was played), the history of the latest answer is trimmed the same way."""
        played = frames_played if frames_played is not None else 1 << 30
        if self._answering:
            self._interrupt = played
            if self._answer is not None:
                self._answer.interrupt(played)
        elif frames_played is not None and not self.closed and (context := await self._made_context()) is not None:
            await self._run_turn(context.trim_last_answer, frames_played)

    async def close(self) -> None:
        """End the call: its answer stops, and its slot goes back to the engine."""
        if self.closed:
            return
        self.closed = True
        if self._answer is not None:
            self._answer.interrupt(0)
        self._release.detach()
        await self._run(self.engine.release, self._slot)
        self._context = self._making = None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this session is closed")


async def _drain(events: AsyncIterator[Event]) -> None:
    async for _ in events:
        pass


def _release_later(engine: Engine, slot: Slot) -> None:
    """A session was dropped without `close()`: give its slot back on the worker."""
    try:
        engine._worker.submit(lambda: engine.release(slot), key=slot.index)
    except RuntimeError:  # the engine is closed
        pass


def _check_time(at: float) -> float:
    if not isinstance(at, (int, float)) or not np.isfinite(at) or at < 0:
        raise ValueError(f"a media-clock time must be a finite number of seconds >= 0, got {at!r}")
    return float(at)
