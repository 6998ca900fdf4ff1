"""One call's turn-taking: listening -> thinking -> speaking -> listening, with barge-in and push-to-talk.

The caller's audio arrives as 32 ms chunks (16 kHz mono float32). While the caller speaks, the chunks stream
into the engine session (it prefills as it goes); when the turn ends, the engine answers, and the answer's
frames go to the outbound track. Every engine call runs on one worker task, in the order it was asked for, so
audio spoken during an answer (a barge-in) reaches the engine after that answer has been cut.

Audio and video share one media clock: the caller audio received since the call started. Each chunk keeps its
time on that clock (pre-roll and held speech go in late, at their own times); a sampled video frame is stamped
with the clock as it comes in and queued on the same worker, so it reaches the engine before any later audio.

With server_vad a fixed silence (silence_ms) ends the turn. With semantic_vad the end-of-turn model scores the
turn at the first short silence and again as the silence goes on (media/end_of_turn.py); the turn ends at its
first confident "complete", or after the eagerness's longest wait.

Events go out through `send` as typed events named after OpenAI Realtime events (conversation_events.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import itertools
import logging
import math
import secrets
import time
from typing import Any, Callable, Coroutine, Literal

import numpy as np

from . import conversation_events as said
from .config import TurnSettings
from .engine.model.memory import EngineOutOfMemory
from .engine.scheduler.policy import PREPARE_AFTER_SILENCE_MS
from .engine.ipc.session_protocol import EngineSession
from .engine.events import (LIMITS, ResponseDone, SpeechFrame, TextDelta, ToolCallArguments, ToolCallDone,
                            ToolCallStarted)
from .engine.step.tools import ToolSet
from .media.captions import CaptionPool, Captions, Transcription
from .media.end_of_turn import EAGERNESS, EndOfTurnScorer, SemanticTurn
from .media.outbound import PACKET_S, AnswerOutput, Playout
from .media.vad import CHUNK_MS, CHUNK_SAMPLES, Signal, TurnDetector

log = logging.getLogger(__name__)
NO_SEMANTIC_VAD = "semantic_vad is not available on this server (the end-of-turn model is not installed)"
NO_SPEECH = "this server answers in text only (it runs without the Talker: --no-talker)"
NO_TRANSCRIPTION = "transcription is not available on this server (the speech recogniser is not installed)"
MAX_PUSHES_IN_FLIGHT = 4  # audio pushes sent to the engine and not yet taken in (32 ms of audio each, as it comes)


class State(str, enum.Enum):
    LISTENING = "listening"
    THINKING = "thinking"  # the turn ended; no answer audio out yet
    SPEAKING = "speaking"
    INTERRUPTED = "interrupted"  # the answer was cut; the engine is winding down


@dataclasses.dataclass(frozen=True)
class Audio:
    """Caller audio: whole 32 ms chunks, and the media-clock time of their first sample."""

    at_ms: int
    samples: np.ndarray

    @property
    def end_ms(self) -> int:
        return self.at_ms + len(self.samples) // CHUNK_SAMPLES * CHUNK_MS


@dataclasses.dataclass
class FunctionCall:
    """A function call of an answer, as the client is told of it."""

    call_id: str
    name: str
    arguments: str = ""  # what was sent of its arguments so far
    done: bool = False  # its whole arguments were sent


@dataclasses.dataclass
class Answer:
    id: str
    turn_end_at: float  # time.monotonic() when the turn was over (hang-over elapsed, or commit)
    speech_end_at: float  # when the caller's speech itself stopped (turn_end_at minus the hang-over)
    end_of_turn: dict[str, Any] = dataclasses.field(default_factory=dict)  # how the turn's end was decided
    playout: Playout | None = None
    respond_at: float | None = None  # when the engine was asked for the answer (after the turn's audio went in)
    first_text_at: float | None = None  # when its first text went out
    cancelled: bool = False
    text_only: bool = False  # written, not spoken: its text goes out as response.output_text.*
    calls: list[FunctionCall] = dataclasses.field(default_factory=list)  # in the engine's order (its `index`)


@dataclasses.dataclass(frozen=True)
class PushImage:
    image: np.ndarray
    at: float  # on the media clock, seconds


@dataclasses.dataclass(frozen=True)
class PushText:
    text: str


@dataclasses.dataclass(frozen=True)
class PushToolOutput:
    output: str


@dataclasses.dataclass(frozen=True)
class TrimAnswer:
    frames_heard: int


@dataclasses.dataclass(frozen=True)
class PrepareAnswer:
    queued_at: float  # time.monotonic()


@dataclasses.dataclass(frozen=True)
class AbortTurn:
    pass


# the worker's queue
EngineCall = Audio | PushImage | PushText | PushToolOutput | TrimAnswer | PrepareAnswer | AbortTurn | Answer


class Conversation:
    def __init__(
        self,
        session: EngineSession,
        track: AnswerOutput,
        send: Callable[[said.ConversationEvent], None],
        vad: Callable[[np.ndarray], float],
        turn: TurnSettings,
        on_answer: Callable[[dict[str, Any]], None] = lambda metrics: None,
        end_of_turn: EndOfTurnScorer | None = None,
        speech: bool = True,
        loop_lag_since: Callable[[float], float | None] | None = None,
        captions: CaptionPool | None = None,
        transcription: Transcription | None = None,
    ) -> None:
        """`captions`: the process's speech recogniser (None: not installed); `transcription`: whether this call's
        caller gets captions of their words (conversation.item.input_audio_transcription.*)."""
        self.session = session
        self.speech_available = speech  # False: the engine has no Talker (--no-talker); every answer is text
        self.text_only = not speech  # this call's answers are text (session.update's output_modalities)
        self.tools = ToolSet()  # the functions the model may call (session.update's tools and tool_choice)
        self.track = track
        self.turn = turn
        self.state = State.LISTENING
        self._send = send
        self._vad = vad
        self._on_answer = on_answer
        self._scorer = end_of_turn
        self._loop_lag_since = loop_lag_since  # the server's event loop: largest lateness since a time (LoopLag)
        self._semantic: SemanticTurn | None = None  # the end-of-turn model's decisions (semantic_vad)
        self._caption_pool = captions
        self.transcription: Transcription | None = None
        self._captions: Captions | None = None  # the caller's words (while transcription is on)
        self._item_id: str | None = None  # the caller's turn in progress: its conversation item
        self._detector = TurnDetector(turn.vad_threshold, turn.silence_ms, turn.min_speech_ms)
        self._use_turn_settings(turn)
        self._unpushed: collections.deque[Audio] = self._preroll()
        self._held: list[Audio] = []  # caller speech during an answer, before it counts as a barge-in
        self._in_turn = False
        self._turn_confirmed = False
        self._paused: list[Audio] | None = None  # the silence since the engine prepared the answer (None: not paused)
        self._speech_start_ms = 0
        self._input_waiting = False  # committed speech or typed text that no answer has taken yet
        self._clock_ms = 0  # the media clock: audio time since the call started
        self._image_at_ms = -1  # the latest video frame's time
        self._image_refused = False  # the engine refused a video frame (said once per call)
        self._answer: Answer | None = None  # the answer being thought or spoken
        self._active_at = time.monotonic()  # when the caller last spoke or the last answer ended
        self._ids = itertools.count(1)
        self._call_ids: dict[str, bool] = {}  # the calls the answers made: whether each has its output yet
        self._ops: asyncio.Queue[EngineCall] = asyncio.Queue()
        self._urgent_queued = 0  # preparations and answers in `_ops`: an audio push waiting for room gives way
        self._urgent_came = asyncio.Event()
        self._pushes: list[asyncio.Task[None]] = []  # audio pushes on their way to the engine
        self._worker: asyncio.Task[None] | None = asyncio.create_task(self._work(), name="conversation-worker")
        self._side_tasks: set[asyncio.Task[None]] = set()
        # time.monotonic() of the latest audio push (started, done) and answer preparation (queued, started, done):
        # where a turn's audio_in_ms and first packet went (response.done's metrics)
        self._pushed_times: tuple[float, ...] = ()
        self._prepared_times: tuple[float, ...] = ()
        self.set_transcription(transcription)

    # ---- caller audio -------------------------------------------------------------------------------------
    def feed(self, samples: np.ndarray) -> None:
        """One 32 ms chunk of caller audio."""
        p = self._vad(samples)
        signal = self._detector.feed(p)
        if self._detector.active:
            self._active_at = time.monotonic()
        chunk = Audio(self._clock_ms, samples)
        self._clock_ms += CHUNK_MS
        if self._answer is not None and self.state != State.INTERRUPTED:
            self._during_answer(chunk, signal)
        else:
            self._listening(chunk, signal)

    def _listening(self, chunk: Audio, signal: Signal | None) -> None:
        if signal in (Signal.ONSET, Signal.CONFIRMED) and not self._in_turn:
            self._begin_turn([*self._unpushed, chunk])
        elif self._in_turn and (self._detector.active or signal in (Signal.ENDED, Signal.FALSE_START)):
            chunks = [*self._unpushed, chunk]  # (the pre-roll when push-to-talk speech resumes)
            self._unpushed.clear()
            if self._captions is not None:
                speaking = self._detector.active and not self._detector.silence_run_ms
                for c in chunks:
                    self._captions.add(c.samples, speaking)
            if self._paused is None:
                self._push(chunks)
            elif self._detector.active and not self._detector.silence_run_ms:  # speech again: the turn goes on
                self._push(self._paused, end_of_turn_model=False)
                self._push(chunks)
                self._paused = None
            else:  # the pause goes on: its silence stays out of the prepared answer's turn
                self._paused += chunks
                self._semantic_add(chunks)
            if self._turn_confirmed and self._detector.silence_run_ms // CHUNK_MS == self._prepare_after_ms // CHUNK_MS:
                # the turn may be ending: the engine makes the answer ready (the call's audio still queued there
                # becomes as urgent, so that the preparation does not wait for it behind other calls' work)
                self._queue_urgent(PrepareAnswer(time.monotonic()))
                self._paused = []
        else:
            self._unpushed.append(chunk)
        if signal is Signal.CONFIRMED:
            self._confirm_turn()
        elif signal is Signal.FALSE_START and not self._turn_confirmed:
            self._in_turn = False
            self._ops.put_nowait(AbortTurn())
            if self._captions is not None:
                self._captions.drop()
        elif signal is Signal.ENDED:
            self._speech_over(self._detector.end_silence_ms)
        elif self._semantic is not None and self._turn_confirmed and self._detector.active:
            self._semantic.silence(self._detector.silence_run_ms)

    def _speech_over(self, wait_ms: int) -> None:
        """The caller's speech ended `wait_ms` ago (the hang-over, or when the end-of-turn model said so)."""
        self._emit(said.SpeechStopped(self._clock_ms - wait_ms, self._item_id))
        if self.turn.auto:
            self._end_turn(hangover_ms=wait_ms)

    def _turn_complete(self) -> None:
        """The end-of-turn model's verdict "complete", while the caller is still silent after their speech."""
        if self._in_turn and self._turn_confirmed and self._detector.active and self._detector.silence_run_ms:
            wait_ms = self._detector.silence_run_ms
            self._detector.reset()
            self._speech_over(wait_ms)

    def _during_answer(self, chunk: Audio, signal: Signal | None) -> None:
        if signal is Signal.ONSET or (signal is Signal.CONFIRMED and not self._held):
            self._held = [*self._unpushed, chunk]
            self._unpushed.clear()
            self._speech_start_ms = self._clock_ms - CHUNK_MS
        elif self._detector.active or signal is Signal.FALSE_START:
            self._held.append(chunk)
        else:
            self._unpushed.append(chunk)
        if signal is Signal.CONFIRMED:  # speech for barge_in_ms: the caller takes the floor
            self._interrupt()
            self._begin_turn(self._held, start_ms=self._speech_start_ms)
            self._held = []
            self._confirm_turn()
        elif signal is Signal.FALSE_START:  # a short "mm-hm", a cough or an echo: the answer goes on
            self._held = []

    def _begin_turn(self, chunks: list[Audio], start_ms: int | None = None) -> None:
        self._in_turn, self._turn_confirmed = True, False
        self._paused = None
        self._speech_start_ms = self._clock_ms - CHUNK_MS if start_ms is None else start_ms
        self._unpushed.clear()
        self._item_id = f"item_{secrets.token_hex(8)}"
        if self._semantic is not None:
            self._semantic.start([])
        if self._captions is not None:
            self._captions.begin(self._item_id, [c.samples for c in chunks],
                                 lead_ms=self._speech_start_ms - chunks[0].at_ms if chunks else 0)
        self._push(chunks)

    def _confirm_turn(self) -> None:
        self._turn_confirmed = True
        if self._captions is not None:
            self._captions.confirm()
        self._emit(said.SpeechStarted(self._speech_start_ms, self._item_id))

    def _push(self, chunks: list[Audio], end_of_turn_model: bool = True) -> None:
        """Chunks received one after the other (a run never has a gap) go to the engine at their own time (and to
        the end-of-turn model, which has not had them yet)."""
        if chunks:
            self._ops.put_nowait(Audio(chunks[0].at_ms, np.concatenate([c.samples for c in chunks])))
            if end_of_turn_model:
                self._semantic_add(chunks)

    def _semantic_add(self, chunks: list[Audio]) -> None:
        if self._semantic is not None:
            self._semantic.add([c.samples for c in chunks])

    # ---- caller video -------------------------------------------------------------------------------------
    def see(self, image: np.ndarray) -> None:
        """One sampled caller video frame (RGB uint8 [H, W, 3]), stamped with the media clock now. Audio and
        video arrive in real time, so they line up within network jitter. A frame with no audio received since
        the previous one (the first moments of a call) would add nothing new in time: it is dropped."""
        if self._clock_ms <= self._image_at_ms:
            return
        self._image_at_ms = self._clock_ms
        self._ops.put_nowait(PushImage(image, self._clock_ms / 1000))

    def _end_turn(self, hangover_ms: int | None = None, respond: bool = True) -> None:
        """The caller's speech is committed: after `hangover_ms` of silence (automatic turns) or now (None: a
        commit); with `respond`, the answer starts."""
        self._in_turn = self._turn_confirmed = False
        self._paused = None  # the pause's silence is left out of the turn: it is over
        end_of_turn = self._end_of_turn_metrics(hangover_ms)
        committed = self._committed()
        if not respond:
            self._input_waiting = True
            self._emit(committed)
            return
        self._start_answer(hangover_ms or 0, committed=committed, end_of_turn=end_of_turn)

    def _committed(self) -> said.Committed:
        """input_audio_buffer.committed for the turn just over: its item, and with captions on, its parts'
        transcripts as they stand (None: on its way; each comes in its own `completed` event)."""
        return said.Committed(self._item_id, None if self._captions is None else self._captions.end())

    def _start_answer(self, hangover_ms: int = 0, committed: said.Committed | None = None,
                      end_of_turn: dict[str, Any] | None = None) -> None:
        now = time.monotonic()
        self._input_waiting = False
        answer = Answer(id=f"resp_{next(self._ids)}", turn_end_at=now, speech_end_at=now - hangover_ms / 1000,
                        end_of_turn=end_of_turn or {"type": "commit", "wait_ms": None}, text_only=self.text_only)
        self._answer = answer
        self._detector.min_speech_ms = self.turn.barge_in_ms
        self._set_state(State.THINKING)
        if committed is not None:
            self._emit(committed)
        self._emit(said.ResponseCreated(answer.id, answer.text_only))
        self._queue_urgent(answer)

    # ---- client requests ----------------------------------------------------------------------------------
    def commit(self, respond: bool = True) -> None:
        """input_audio_buffer.commit: the caller's turn is over now (push-to-talk). Without `respond` the speech
        waits for `create_response` (the Realtime API's commit)."""
        if respond:
            self._check_no_answer()
        if not self._in_turn:
            raise ConversationError("input_audio_buffer_commit_empty", "no speech since the last turn")
        if self._detector.active and self._turn_confirmed:
            self._emit(said.SpeechStopped(self._clock_ms, self._item_id))
        self._detector.reset()
        self._end_turn(respond=respond)

    def clear_input(self) -> None:
        """input_audio_buffer.clear: the speech of the turn in progress (not yet committed) is dropped. Speech
        committed without an answer yet shares the engine's turn with it and is dropped too."""
        cleared = self._item_id if self._in_turn else None
        if self._in_turn:
            self._in_turn = self._turn_confirmed = False
            self._detector.reset()
            self._ops.put_nowait(AbortTurn())
            if self._captions is not None:
                self._captions.drop()
        self._unpushed.clear()
        self._paused = None
        self._emit(said.Cleared(cleared))

    def add_text(self, text: str) -> None:
        """A typed message from the caller: it joins the caller's turn; `create_response` answers it."""
        self._input_waiting = True
        self._ops.put_nowait(PushText(text))

    def add_tool_output(self, call_id: str, output: str) -> None:
        """A function_call_output: what the application's function returned for `call_id`, a call an answer of
        this conversation made. It joins the caller's turn, in the order outputs come; `create_response` goes on
        from it. Each call takes one output."""
        answered = self._call_ids.get(call_id)
        if answered is None:
            raise ConversationError("invalid_value", f"call_id {call_id[:64]!r} is not a function call of this "
                                                     "conversation")
        if answered:
            raise ConversationError("invalid_value", f"the call {call_id[:64]!r} already has its output")
        self._call_ids[call_id] = True
        self._input_waiting = True
        self._ops.put_nowait(PushToolOutput(output))

    def create_response(self) -> None:
        """response.create: answer now, taking the speech in progress (committed now) and what was committed or
        typed since the last answer."""
        self._check_no_answer()
        if self._in_turn:
            self.commit()
        elif self._input_waiting:
            self._start_answer()
        else:
            raise ConversationError("response_create_empty", "nothing new from the caller to answer")

    def cancel_response(self) -> None:
        """response.cancel."""
        if self._answer is None or self.state == State.INTERRUPTED:
            raise ConversationError("response_cancel_not_active", "there is no answer to cancel")
        self._interrupt()

    @property
    def answering(self) -> bool:
        """An answer is being thought or spoken (and not already cut)."""
        return self._answer is not None and self.state != State.INTERRUPTED

    def set_transcription(self, transcription: Transcription | None) -> None:
        """Captions of the caller's words on (from the next turn) or off (at once). ValueError where this server
        has no recogniser."""
        if transcription is not None and self._caption_pool is None:
            raise ValueError(NO_TRANSCRIPTION)
        self.transcription = transcription
        if transcription is None and self._captions is not None:
            self._captions.close()
            self._captions = None
        elif transcription is not None and self._captions is None and self._caption_pool is not None:
            self._captions = Captions(self._caption_pool, self._emit)

    def input_lost(self) -> None:
        """The caller's audio stopped coming (the connection died): the caption being spoken completes."""
        if self._captions is not None:
            self._captions.flush()

    def use_track(self, track: AnswerOutput) -> None:
        """Answers go out on `track` from now on (a resumed call's new peer connection)."""
        self.track = track

    def truncate_answer(self, frames_heard: int) -> None:
        """conversation.item.truncate: the caller heard only the first `frames_heard` frames of the latest answer.
        An answer still in progress is cut there; a finished one keeps only that much text in the history."""
        if self._answer is not None and self.state != State.INTERRUPTED:
            self._interrupt(frames_heard)
        else:
            self._ops.put_nowait(TrimAnswer(frames_heard))

    def _check_no_answer(self) -> None:
        if self._answer is not None and self.state != State.INTERRUPTED:
            raise ConversationError("conversation_already_has_active_response", "an answer is in progress")

    def update(self, voice: str | None, instructions: str | None, turn: TurnSettings | None,
               text_only: bool | None = None, tools: ToolSet | None = None, language: str | None = None,
               transcription: Transcription | Literal["off"] | None = None) -> None:
        """session.update; the voice, instructions, output (`text_only`), tools and language lock (a code, "" for
        none) apply from the next answer, transcription ("off", or on) from the next turn (ValueError on bad
        values: then nothing changes)."""
        changes: dict[str, Any] = {k: v for k, v in (("voice", voice), ("instructions", instructions), ("tools", tools))
                                   if v is not None}
        if language is not None:
            changes["language"] = language or None
        if turn is not None and turn.auto and turn.turn_detection == "semantic_vad" and self._scorer is None:
            raise ValueError(NO_SEMANTIC_VAD)
        if text_only is False and not self.speech_available:
            raise ValueError(NO_SPEECH)
        if isinstance(transcription, Transcription) and self._caption_pool is None:
            raise ValueError(NO_TRANSCRIPTION)
        if text_only is not None:
            changes["speech"] = not text_only
        if changes:
            self.session.update(**changes)
        if transcription is not None:
            self.set_transcription(None if transcription == "off" else transcription)
        if text_only is not None:
            self.text_only = text_only
        if tools is not None:
            self.tools = tools
        if turn is not None:
            self._use_turn_settings(turn)
            self._detector.min_speech_ms = turn.barge_in_ms if self._answer else turn.min_speech_ms
            self._unpushed = collections.deque(self._unpushed, maxlen=self._preroll().maxlen)

    @property
    def last_active_at(self) -> float:
        """time.monotonic() when the caller last spoke or an answer last ran (now, while one is under way)."""
        return time.monotonic() if self._answer is not None else self._active_at

    def _use_turn_settings(self, turn: TurnSettings) -> None:
        self.turn = turn
        self._prepare_after_ms = PREPARE_AFTER_SILENCE_MS
        self._detector.threshold = turn.vad_threshold
        self._detector.silence_ms = self._detector.end_silence_ms = turn.silence_ms
        if self._semantic is not None:
            self._semantic.close()
            self._semantic = None
        if turn.auto and turn.turn_detection == "semantic_vad":
            if self._scorer is None:
                raise ValueError(NO_SEMANTIC_VAD)
            eagerness = EAGERNESS[turn.eagerness]
            self._semantic = SemanticTurn(self._scorer, eagerness, self._turn_complete)
            self._detector.end_silence_ms = eagerness.max_wait_ms
            # The answer is made ready from the chunk before the first check on (auto: the pause's first silent
            # chunk), so that the engine has two chunks, not one, before the turn can end (EARLIEST_END_MS): 24
            # callers' preparations took 57-94 ms from the last of their asks to their first frames on the H200
            # (heard at 24 at once 236.6 -> 225.1 ms P50, asking at 32 instead of 64 ms; docs/performance.md,
            # "Many callers at once"). A pause inside the speech costs one preparation more
            # (undone: the engine's work only), 0.6-0.8 per espeak-ng sentence of the turn-taking sets.
            self._prepare_after_ms = min(PREPARE_AFTER_SILENCE_MS, max(CHUNK_MS, eagerness.first_check_ms - CHUNK_MS))

    def _end_of_turn_metrics(self, wait_ms: int | None) -> dict[str, Any]:
        """How this turn's end was decided, for response.done (and the end-of-turn wait histogram)."""
        kind = "commit" if wait_ms is None else self.turn.turn_detection
        out: dict[str, Any] = {"type": kind, "wait_ms": wait_ms}
        semantic = self._semantic
        if semantic is not None:
            out.update(probability=None if semantic.probability is None else round(semantic.probability, 3),
                       eagerness=self.turn.eagerness, decisions=len(semantic.decisions),
                       decision_cpu_ms=[d.cost_ms for d in semantic.decisions],
                       decision_threads=[d.threads for d in semantic.decisions],
                       checked_at_ms=semantic.checked_at_ms, verdict_ms=semantic.verdict_ms)
            words = semantic.words
            if words is not None:  # the last words, where a recogniser heard them
                p = words.end_probability
                out.update(words=words.text, words_end_probability=None if p is None else round(p, 4),
                           words_unfinished=words.unfinished, words_cpu_ms=words.cost_ms)
            semantic.stop()
        return out

    # ---- answers ------------------------------------------------------------------------------------------
    def _interrupt(self, frames_heard: int | None = None) -> None:
        answer = self._answer
        if answer is None:
            return
        answer.cancelled = True
        self._set_state(State.INTERRUPTED)
        self._detector.min_speech_ms = self.turn.min_speech_ms
        if answer.playout is not None:  # the engine is answering (or done): cut it where the caller stopped hearing
            self.track.interrupt()
            sent = answer.playout.frames_sent
            self._spawn(self.session.cancel(sent if frames_heard is None else min(sent, frames_heard)))

    async def _answer_one(self, answer: Answer) -> None:
        playout = answer.playout = self.track.start_playout(speech=not answer.text_only)
        done: ResponseDone | None = None
        error: str | None = None
        if answer.cancelled:  # cut before the engine began: its audio stays, the caller's turn goes on
            playout.interrupt()
            self._finish_answer(answer, playout, done, error)
            return
        answer.respond_at = time.monotonic()
        try:
            async for event in self.session.respond():
                if isinstance(event, TextDelta):
                    if not answer.cancelled:
                        answer.first_text_at = answer.first_text_at or time.monotonic()
                        delta = said.OutputTextDelta if answer.text_only else said.OutputAudioTranscriptDelta
                        self._emit(delta(answer.id, event.text))
                elif isinstance(event, SpeechFrame):
                    if not answer.cancelled:
                        playout.push(event.samples)
                        if self.state == State.THINKING:
                            self._set_state(State.SPEAKING)
                elif isinstance(event, (ToolCallStarted, ToolCallArguments, ToolCallDone)):
                    if not answer.cancelled:
                        self._call_event(answer, event)
                elif isinstance(event, ResponseDone):
                    done = event
            playout.finish()
            await playout.done.wait()
        except Exception as exc:  # the engine failed this answer: say so, keep the call
            log.exception("answer %s failed", answer.id)
            error = str(exc) or type(exc).__name__
            playout.interrupt()
            self._emit(said.Error(_error_code(exc), error))
        finally:
            self._finish_answer(answer, playout, done, error)

    def _finish_answer(self, answer: Answer, playout: Playout, done: ResponseDone | None, error: str | None) -> None:
        interrupted = answer.cancelled or playout.interrupted or bool(done and done.interrupted)
        metrics: dict[str, Any] = {
            "ttfp_ms": _ms(playout.first_packet_at, answer.turn_end_at),
            "ttft_ms": _ms(answer.first_text_at, answer.turn_end_at),  # turn end → the first text sent
            "speech_end_to_first_packet_ms": _ms(playout.first_packet_at, answer.speech_end_at),
            "audio_in_ms": _ms(answer.respond_at, answer.turn_end_at),  # the turn's last audio into the engine
            # ms from the turn's end (negative: before it): the last audio push's start and end, and the answer's
            # preparation: queued, started, done (null: none since the answer before)
            "audio_in_parts": {"push": [_ms(t, answer.turn_end_at) for t in self._pushed_times],
                               "prepare": [_ms(t, answer.turn_end_at) for t in self._prepared_times]},
            "frames": playout.frames_made,
            "frames_sent": playout.frames_sent,
            "frames_late": playout.frames_late,
            "frames_dropped": playout.frames_dropped,
            "audio_s": round(playout.frames_sent * PACKET_S, 3),
            "interrupted": interrupted,
            "end_of_turn": answer.end_of_turn,
            "engine": dict(done.metrics) if done else {},
            # how late the server's event loop woke up, from the end of the speech to the answer's end: high when
            # the media of all calls wait for the CPU (the turn's end noticed late, packets sent late)
            "loop_lag_ms_max": self._loop_lag_since(answer.speech_end_at) if self._loop_lag_since else None,
        }
        self._pushed_times = self._prepared_times = ()
        cut_by = done.ended if done and done.ended in LIMITS else None  # a limit stopped it: max_output_tokens, ...
        status = "failed" if error else "cancelled" if interrupted else "incomplete" if cut_by else "completed"
        text = done.text if done else ""
        for call in done.tool_calls if done else ():  # those still unsaid (made after a cut): all complete calls
            self._call_event(answer, call)  # are in the history, so the application must know of them
        calls = tuple(said.FunctionCallMade(c.call_id, c.name, c.arguments) for c in answer.calls if c.done)
        if answer.text_only:
            self._emit(said.OutputTextDone(answer.id, text))
        self._emit(said.ResponseDone(answer.id, status, interrupted, metrics, cut_by, answer.text_only, text, calls))
        self._on_answer(metrics)
        log.info("answer %s %s: ttfp %s ms, %d frames", answer.id, status, metrics["ttfp_ms"], playout.frames_sent)
        self._active_at = time.monotonic()
        if self._answer is answer:
            self._answer = None
            self._detector.min_speech_ms = self.turn.min_speech_ms
            self._set_state(State.LISTENING)
            if self._held:  # the caller was already speaking as the answer ended: that is the next turn
                self._begin_turn(self._held, start_ms=self._speech_start_ms)
                self._held = []
                if self._detector.speech_ms >= self.turn.min_speech_ms:
                    self._detector.confirmed = True
                    self._confirm_turn()
        if self._answer is None and self.state == State.INTERRUPTED:
            self._set_state(State.LISTENING)

    def _call_event(self, answer: Answer, event: ToolCallStarted | ToolCallArguments | ToolCallDone) -> None:
        """A function call's progress, as `response.function_call_arguments.delta` and `.done` events (a call cut
        before its end gets no `.done`: the engine drops it)."""
        if isinstance(event, ToolCallStarted) or (isinstance(event, ToolCallDone) and event.index == len(answer.calls)):
            answer.calls.append(FunctionCall(f"call_{secrets.token_hex(12)}", event.name))  # (its start was unsaid)
        if isinstance(event, ToolCallStarted):
            return
        call = answer.calls[event.index]
        if call.done:
            return
        delta = event.delta if isinstance(event, ToolCallArguments) else event.arguments[len(call.arguments):]
        if delta:
            call.arguments += delta
            self._emit(said.FunctionCallArgumentsDelta(answer.id, call.call_id, call.name, delta))
        if isinstance(event, ToolCallDone):
            call.done = True
            self._call_ids[call.call_id] = False
            self._emit(said.FunctionCallArgumentsDone(answer.id, call.call_id, call.name, call.arguments))

    # ---- the engine worker --------------------------------------------------------------------------------
    async def _work(self) -> None:
        following: EngineCall | None = None
        while True:
            call = following or self._taken(await self._ops.get())
            following = None
            try:
                match call:
                    case Audio():  # audio queued up back to back, with no gap, goes to the engine in one call
                        await self._room_for_push()
                        run = [call]
                        while following is None and not self._ops.empty():
                            following = self._taken(self._ops.get_nowait())
                            if isinstance(following, Audio) and following.at_ms == run[-1].end_ms:
                                run.append(following)
                                following = None
                        # (the caller paused and the answer's preparation is next: its audio is as urgent as it)
                        await self._push_audio(np.concatenate([a.samples for a in run]), run[0].at_ms / 1000,
                                               urgent=isinstance(following, PrepareAnswer))
                    case PushImage(image, at):
                        await self._push_image(image, at)
                    case PushText(text):
                        await self.session.push_text(text)
                    case PushToolOutput(output):
                        await self.session.push_tool_output(output)
                    case TrimAnswer(frames_heard):
                        await self.session.cancel(frames_heard)
                    case PrepareAnswer(queued_at):
                        await self._prepare(queued_at)
                    case AbortTurn():
                        await self.session.abort_turn()
                    case Answer():
                        await self._answer_one(call)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._engine_call_failed(type(call).__name__, exc)

    def _engine_call_failed(self, name: str, exc: Exception) -> None:
        """An engine call failed: say so to the client; the call goes on."""
        log.exception("engine call %s failed", name, exc_info=exc)
        self._emit(said.Error(_error_code(exc), str(exc) or type(exc).__name__))

    def _queue_urgent(self, op: PrepareAnswer | Answer) -> None:
        self._urgent_queued += 1
        self._urgent_came.set()
        self._ops.put_nowait(op)

    def _taken(self, op: EngineCall) -> EngineCall:
        """`op`, just taken from `_ops`."""
        if isinstance(op, (PrepareAnswer, Answer)):
            self._urgent_queued -= 1
        return op

    async def _room_for_push(self) -> None:
        """Wait while MAX_PUSHES_IN_FLIGHT audio pushes are in flight (the audio that comes meanwhile then goes in
        one push), but not once a preparation or an answer is queued: it goes to the engine at once, which makes
        the session's audio still waiting there as urgent. (With 48 callers at once on an H200, the pushes waited
        250-535 ms in the engine behind the other calls' rounds and steps, and the preparations here behind them:
        server first packet P50 610 ms against 118 in the next load, `studies/worker_trace.py`.)"""
        while len(self._pushes) >= MAX_PUSHES_IN_FLIGHT and not self._urgent_queued:
            self._urgent_came.clear()
            came = asyncio.ensure_future(self._urgent_came.wait())
            try:
                await asyncio.wait([self._pushes[0], came], return_when=asyncio.FIRST_COMPLETED)
            finally:
                came.cancel()

    async def _push_audio(self, samples: np.ndarray, at: float, urgent: bool) -> None:
        """Send caller audio to the engine without waiting for it to be taken in (`_call_on`): a preparation queued
        behind it goes out at once instead of after its reply (`_room_for_push` bounds the pushes in flight)."""
        started = time.monotonic()

        def pushed() -> None:
            self._pushed_times = (started, time.monotonic())

        task = await self._call_on(self.session.push_audio(samples, at=at, urgent=urgent), "push_audio", pushed)
        self._pushes.append(task)
        task.add_done_callback(self._pushes.remove)

    async def _prepare(self, queued_at: float) -> None:
        """Ask the engine to prepare the answer without waiting for it to be ready (`_call_on`): an answer asked for
        while it is still being made starts the moment it is ready, on the engine's side. (Awaited here, the
        answer's request went out only once the preparation's reply came back, and then waited behind a step of
        the other calls' answers: 10-28 ms P50 of 24 at once, against 0.5-1.4 ms now, measured on an H200 with
        `studies/device_loadtest.sh`.)"""
        started = time.monotonic()

        def prepared() -> None:
            self._prepared_times = (queued_at, started, time.monotonic())

        await self._call_on(self.session.prepare_answer(), "prepare_answer", prepared)

    async def _call_on(self, call: Coroutine[Any, Any, None], name: str,
                       done: Callable[[], None]) -> asyncio.Task[None]:
        """Start an engine call and go on without its reply. The engine runs a call's work in the order it was
        asked for (each session method queues it, or sends its request, before it first waits), so what this loop
        sends next goes after it there. A failure is said as any engine call's is; `done()` runs on success."""
        async def sent() -> None:
            try:
                await call
            except Exception as exc:
                self._engine_call_failed(name, exc)
            else:
                done()

        task = asyncio.ensure_future(sent())
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
        await asyncio.sleep(0)  # (ready callbacks run in order: the call's first step runs before this goes on)
        return task

    async def _push_image(self, image: np.ndarray, at: float) -> None:
        try:
            await self.session.push_image(image, at)
        except ValueError as exc:  # the engine refuses the frame: say it once; the call goes on
            if not self._image_refused:
                self._image_refused = True
                log.warning("the engine refused a video frame: %s", exc)
                self._emit(said.Error("invalid_image", str(exc)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_task_done)

    def _side_task_done(self, task: asyncio.Task[None]) -> None:
        self._side_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("an engine call on the side failed: %r", task.exception())

    async def close(self) -> None:
        if self._semantic is not None:
            self._semantic.close()
        if self._captions is not None:
            self._captions.close()
            self._captions = None
        self.track.interrupt()
        worker, self._worker = self._worker, None  # (its CancelledError's traceback refers back to self)
        tasks = [t for t in (worker, *self._side_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._send = self._on_answer = _ignore  # a closed conversation says nothing more (and keeps no caller)
        await self.session.close()

    # ---- helpers ------------------------------------------------------------------------------------------
    def _preroll(self) -> collections.deque[Audio]:
        return collections.deque(maxlen=max(1, math.ceil(self.turn.prefix_padding_ms / CHUNK_MS)))

    def _set_state(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self._emit(said.ConversationState(state.value))

    def _emit(self, event: said.ConversationEvent) -> None:
        """Through `send` while the conversation is open (the captions' events too: `close` silences both)."""
        self._send(event)


class ConversationError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _error_code(exc: Exception) -> str:
    """The `error` event's code for an engine failure: out_of_memory (the GPU ran out; the turn or answer was
    dropped, the call goes on) or engine_error."""
    return "out_of_memory" if isinstance(exc, EngineOutOfMemory) else "engine_error"


def _ignore(_: said.ConversationEvent) -> None:
    pass


def _ms(t: float | None, since: float) -> float | None:
    return None if t is None else round((t - since) * 1000, 1)
