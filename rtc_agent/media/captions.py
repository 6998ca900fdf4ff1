"""Live captions of the caller's words, kept up to date while they speak.

Qwen3-Omni hears the caller's audio directly, so nothing else in the product writes down what was said. A speech
recogniser beside the turn detector does: each turn (one conversation item) is cut into parts at the caller's
pauses (PART_PAUSE_MS of silence by the VAD) and, in a monologue, at most every MAX_PART_S; a part is one
`input_audio` content of the item, with its own deltas and one `completed` transcript.

While a part grows, its audio so far is transcribed again every UPDATE_S of audio (provisional). A word goes out
as a delta once two provisional transcripts in a row agree on it and neither ends with it (the last word of a
transcript of speech cut mid-word is often wrong, and so is its punctuation: "What is the?"). Later provisional
transcripts of the part are made to start with the words already sent (cheaper, and the deltas never contradict
each other). The final one is not, since an early word heard on too little audio may be wrong ("Lease remind me"
for "Please remind me"): the `completed` transcript is the part's text, and the deltas before it were
provisional. The final starts at the part's first silent chunk (so it is usually ready by the time the pause is
long enough to end the part, or the turn ends); speech coming back makes that one provisional.

The recogniser runs on a few threads of the process's own (`CaptionPool`), on CPU time nothing else wants
(`background_priority`): the caller's answer never waits for a caption. Finals go before provisionals, and a
part has at most one provisional waiting: under load the deltas thin out first. Memory is bounded by the part
(MAX_PART_S of audio).

`Recognizer` is the one interface the captions need, so that another recogniser (a real Qwen3-Omni checkpoint's
Thinker can transcribe) can take Moonshine's place.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
from typing import Callable, Protocol, Sequence

import numpy as np

from ..conversation_events import (ConversationEvent, TranscriptionCompleted, TranscriptionDelta,
                                   TranscriptionFailed)
from .end_of_turn import lower_priority
from .vad import CHUNK_MS, CHUNK_SAMPLES

log = logging.getLogger(__name__)
RATE = 16_000
PART_PAUSE_MS = 160  # silence that ends a part (the caller paused)
UPDATE_S = 0.64  # audio between provisional transcripts of a part
MAX_PART_S = 8.0  # a part this long is cut at the quietest moment of its last CUT_SEARCH_S
CUT_SEARCH_S = 0.5
LEAD_IN_CHUNKS = 2  # silence kept before a part that starts after a pause (the recogniser hears the onset)
# A turn's first part starts with at least this much audio before the speech; where the call is younger than that
# (words said as it connects), silence makes up the rest. Moonshine mishears speech that starts at the first sample
# of its input: "What is the weather like in Paris today?" heard with 26 ms before it came out "What is the weapon
# I can paris to me?", and the held-out espeak-ng sentences cut at their onset have a WER of 13.3 % against 8.9-11.1 %
# with 0.1-0.5 s of silence before them.
FIRST_LEAD_IN_MS = 300
CAPTION_NICE = 10  # where SCHED_IDLE is refused: above the end-of-turn model's threads (end_of_turn.SCORING_NICE)


class Recognizer(Protocol):
    """Speech (16 kHz mono float32) -> its words, each with its punctuation. `start`: words the transcript must
    begin with (from an earlier transcript of the same speech by this recogniser); `stop()` true: the transcript
    is no longer wanted, and may end at once with whatever it has. Thread-safe."""

    name: str
    languages: tuple[str, ...]

    def words(self, audio: np.ndarray, start: Sequence[str] = (),
              stop: Callable[[], bool] | None = None) -> list[str]: ...


@dataclasses.dataclass(frozen=True)
class Transcription:
    """A session's transcription setting (the Realtime API's `audio.input.transcription`). The model a client
    names is taken and ignored, as the session's own `model` is: this server has one recogniser."""

    model: str
    language: str | None = None
    prompt: str | None = None  # taken and not used (Moonshine takes no prompt)

    def describe(self) -> dict[str, str | None]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}


@dataclasses.dataclass
class Job:
    """One transcript to make. `done(words, error)` runs on the event loop that submitted it."""

    audio: np.ndarray
    start: tuple[str, ...]
    final: bool
    done: Callable[[list[str] | None, Exception | None], None]
    cancelled: bool = False
    loop: asyncio.AbstractEventLoop | None = None


def default_threads() -> int:
    """One thread on small machines (the 2-core CI machine), two where there are cores to spare."""
    return 1 if (os.cpu_count() or 1) <= 4 else 2


class CaptionPool:
    """The process's recogniser and its threads."""

    def __init__(self, recognizer: Recognizer, threads: int | None = None) -> None:
        self.recognizer = recognizer
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"captions-{n}", daemon=True)
                         for n in range(threads or default_threads())]
        for thread in self._threads:
            thread.start()

    @property
    def name(self) -> str:
        return self.recognizer.name

    def warm_up(self) -> None:
        """The recogniser's first run (slower than the next ones), at start-up rather than in a call."""
        rng = np.random.default_rng(0)
        self.recognizer.words((rng.standard_normal(RATE) * 0.01).astype(np.float32))

    def submit(self, job: Job) -> None:
        job.loop = asyncio.get_running_loop()
        self._queue.put((0 if job.final else 1, next(self._order), job))

    def pending(self) -> int:
        """Jobs queued or being transcribed."""
        return self._queue.unfinished_tasks

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put((2, next(self._order), None))

    def _run(self) -> None:
        background_priority()
        while True:
            _, _, job = self._queue.get()
            try:
                if job is None:
                    return
                if not job.cancelled:
                    self._transcribe(job)
            finally:
                self._queue.task_done()

    def _transcribe(self, job: Job) -> None:
        words: list[str] | None = None
        error: Exception | None = None
        try:
            words = self.recognizer.words(job.audio, job.start, stop=lambda: job.cancelled)
        except Exception as exc:  # said to the caller as a failed transcript; the call goes on
            error = exc
        if job.cancelled:
            return
        try:
            job.loop.call_soon_threadsafe(job.done, words, error)
        except RuntimeError:  # (the event loop is closed: nobody is waiting)
            pass


Emit = Callable[[ConversationEvent], None]


def background_priority() -> None:
    """The calling thread runs only on CPU time no other thread wants (Linux's SCHED_IDLE); where that is refused,
    at a nice value CAPTION_NICE above the process's. Why: at nice 10 the recogniser still took a share of the
    cores from the end-of-turn model's two threads for a lone call on a 2-core machine, which delayed its verdicts
    (one caller, 42 sentences twice, captions on against off: the end-of-turn wait 448 against 304 ms P50)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (0: this thread)
    except (AttributeError, OSError):
        lower_priority(CAPTION_NICE)


def _say_nothing(event: ConversationEvent) -> None:
    pass


@dataclasses.dataclass
class _Turn:
    """A turn's item and its parts' transcripts, in content_index order (None: not in yet)."""

    item_id: str
    transcripts: list[str | None] = dataclasses.field(default_factory=list)
    confirmed: bool = False  # its speech lasted min_speech_ms, or it was committed: its captions may go out
    held: list["_Part"] = dataclasses.field(default_factory=list)  # parts done before that, not yet said


@dataclasses.dataclass
class _Part:
    turn: _Turn
    chunks: list[np.ndarray]
    index: int = -1  # its content_index, given when it first says something (a part that never does takes none)
    committed: list[str] = dataclasses.field(default_factory=list)  # the words sent as deltas
    previous: list[str] | None = None  # the latest provisional transcript
    speech_end: int = 0  # samples up to the end of its latest speech chunk
    asked_at: int = 0  # samples when the latest provisional was asked for
    provisional: Job | None = None
    final: Job | None = None
    final_for: int = 0  # the samples the final was asked for
    final_words: list[str] | None = None  # the final, when it is in and still holds
    silence_ms: int = 0
    over: bool = False  # no more audio: it completes once its final is in
    done: bool = False

    @property
    def samples(self) -> int:
        return len(self.chunks) * CHUNK_SAMPLES

    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks)


class Captions:
    """One call's captions. The conversation hands it each turn's audio chunk by chunk; events go out through
    `emit` with the Realtime API's names: conversation.item.input_audio_transcription.delta / .completed /
    .failed (TranscriptionDelta, TranscriptionCompleted, TranscriptionFailed)."""

    def __init__(self, pool: CaptionPool, emit: Emit) -> None:
        self._pool = pool
        self._emit = emit
        self._turn: _Turn | None = None  # the turn in progress
        self._part: _Part | None = None  # the part being spoken
        self._finishing: list[_Part] = []  # parts over, waiting for their final
        self._lead_in: collections.deque[np.ndarray] = collections.deque(maxlen=LEAD_IN_CHUNKS)
        self._closed = False

    # ---- the conversation's side ----------------------------------------------------------------------------
    def begin(self, item_id: str, chunks: list[np.ndarray], lead_ms: int) -> None:
        """A new turn (its pre-roll and first speech), for the item `item_id`; `lead_ms` of `chunks` come before
        the speech."""
        self.end()
        self._turn = _Turn(item_id)
        silence = [np.zeros(CHUNK_SAMPLES, np.float32)] * max(0, -(-(FIRST_LEAD_IN_MS - lead_ms) // CHUNK_MS))
        self._part = _Part(self._turn, [*silence, *chunks])
        self._part.speech_end = self._part.samples

    def confirm(self) -> None:
        """The turn is speech (it lasted min_speech_ms): its captions may go out."""
        if self._turn is not None:
            self._say_held(self._turn)
        if self._part is not None:
            self._ask(self._part)

    def add(self, chunk: np.ndarray, speaking: bool) -> None:
        """The turn's next chunk; `speaking`: the VAD hears speech in it."""
        if self._turn is None:
            return
        part = self._part
        if part is None:
            if not speaking:
                self._lead_in.append(chunk)
                return
            part = self._part = _Part(self._turn, [*self._lead_in, chunk])
            self._lead_in.clear()
        else:
            part.chunks.append(chunk)
        if speaking:
            part.silence_ms, part.speech_end = 0, part.samples
        else:
            part.silence_ms += CHUNK_MS
            if part.silence_ms == CHUNK_MS:  # the first silence: its final starts now, in case the pause lasts
                self._ask_final(part)
            if part.silence_ms >= PART_PAUSE_MS:
                self._end_part(part)
                self._lead_in.extend(part.chunks[-LEAD_IN_CHUNKS:])
                return
        if part.samples >= MAX_PART_S * RATE:
            self._cut(part)
        else:
            self._ask(part)

    def flush(self) -> None:
        """The part being spoken completes now (the caller's connection is gone); the turn goes on."""
        if self._part is not None:
            self._end_part(self._part)

    def end(self) -> list[str | None]:
        """The turn is over (committed): the part being spoken completes. Returns the turn's transcripts so far,
        one per part (None: on its way)."""
        turn = self._turn
        self.flush()
        self._turn = None
        self._lead_in.clear()
        if turn is None:
            return []
        self._say_held(turn)  # (a push-to-talk turn may be committed before it counts as speech)
        pending = sum(p.turn is turn and p.index < 0 for p in self._finishing)  # (numbered when they are in)
        return [*turn.transcripts, *[None] * pending]

    def drop(self) -> None:
        """The turn is dropped (a false start, or the client cleared it): nothing more is said of it."""
        turn, self._turn, self._part = self._turn, None, None
        for part in [p for p in self._finishing if p.turn is turn] + (turn.held if turn else []):
            self._cancel(part)
            if part in self._finishing:
                self._finishing.remove(part)
        self._lead_in.clear()

    def close(self) -> None:
        """Says nothing more, and lets go of `emit` (the conversation's), so that an ended call is freed by
        reference counting while its jobs still wait in the pool's queue."""
        self._closed = True
        for part in [self._part, *self._finishing]:
            if part is not None:
                self._cancel(part)
        self._part, self._finishing, self._turn = None, [], None
        self._emit = _say_nothing

    # ---- parts ----------------------------------------------------------------------------------------------
    def _ask(self, part: _Part) -> None:
        """A provisional transcript, UPDATE_S after the last one (one waiting at a time)."""
        if not part.turn.confirmed or part.provisional is not None or part.samples - part.asked_at < UPDATE_S * RATE:
            return
        part.asked_at = part.samples
        part.provisional = Job(part.audio(), tuple(part.committed), False,
                               lambda words, error: self._provisional_in(part, words, error))
        self._pool.submit(part.provisional)

    def _ask_final(self, part: _Part) -> None:
        """The part's final transcript, on all its audio so far. A provisional still being made is given up: the
        final hears more, and the recogniser's thread is free for it a decoder step later."""
        if part.provisional is not None:
            part.provisional.cancelled, part.provisional = True, None
        if part.final is not None:
            if part.final_for >= part.speech_end:
                return  # the one on its way already has all the speech
            part.final.cancelled = True
        part.final_for, part.final_words = part.samples, None
        part.final = job = Job(part.audio(), (), True,
                               lambda words, error: self._final_in(part, job, words, error))
        self._pool.submit(job)

    def _end_part(self, part: _Part) -> None:
        part.over = True
        self._part = None
        self._finishing.append(part)
        if part.final_words is not None and part.final_for >= part.speech_end:
            self._complete(part)
        else:
            self._ask_final(part)

    def _cut(self, part: _Part) -> None:
        """A part of MAX_PART_S: it ends at the quietest 64 ms of its last CUT_SEARCH_S, the rest starts the next."""
        audio = part.audio()
        window, step = 2 * CHUNK_SAMPLES, CHUNK_SAMPLES // 4
        search = audio[-int(CUT_SEARCH_S * RATE):]
        energy = np.convolve(search ** 2, np.ones(window), "valid")[::step]
        cut = len(audio) - len(search) + int(np.argmin(energy)) * step + window // 2
        cut -= cut % CHUNK_SAMPLES
        rest = [audio[i:i + CHUNK_SAMPLES] for i in range(cut, len(audio), CHUNK_SAMPLES)]
        part.chunks = [audio[i:i + CHUNK_SAMPLES] for i in range(0, cut, CHUNK_SAMPLES)]
        part.speech_end = min(part.speech_end, part.samples)
        self._end_part(part)
        self._part = _Part(part.turn, rest)
        self._part.speech_end = self._part.samples

    def _cancel(self, part: _Part) -> None:
        part.done = True
        part.final_words = None
        for job in (part.provisional, part.final):
            if job is not None:
                job.cancelled = True

    # ---- transcripts coming back ----------------------------------------------------------------------------
    def _provisional_in(self, part: _Part, words: list[str] | None, error: Exception | None) -> None:
        part.provisional = None
        if part.done or self._closed:
            return
        if error is not None:
            log.warning("a provisional caption failed: %r", error)
            return
        self._hypothesis(part, words or [])
        if self._part is part:
            self._ask(part)

    def _final_in(self, part: _Part, job: Job, words: list[str] | None, error: Exception | None) -> None:
        if part.done or self._closed or job is not part.final:
            return
        if error is not None:
            log.warning("a caption failed: %r", error)
            if part.over:
                self._failed(part, error)
            return
        if part.final_for < part.speech_end:  # the caller spoke again since: a provisional transcript after all
            self._hypothesis(part, words or [])
            return
        part.final_words = words or []
        if part.over:
            self._complete(part)

    def _hypothesis(self, part: _Part, words: list[str]) -> None:
        """Words two transcripts in a row agree on, neither one's last word, go out as a delta."""
        previous, part.previous = part.previous, words
        if previous is None or words[:len(part.committed)] != part.committed:
            return
        agreed = len(part.committed)
        while agreed + 1 < min(len(previous), len(words)) and previous[agreed] == words[agreed]:
            agreed += 1
        if agreed > len(part.committed):
            self._delta(part, words[len(part.committed):agreed])

    def _delta(self, part: _Part, words: list[str]) -> None:
        self._number(part)
        text = " ".join(words)
        first = not part.committed
        part.committed += words
        self._emit(TranscriptionDelta(part.turn.item_id, part.index, text if first else " " + text))

    def _complete(self, part: _Part) -> None:
        part.done = True
        self._finishing.remove(part)
        if not part.turn.confirmed:  # (said once the turn counts: a false start never does)
            part.turn.held.append(part)
            return
        words = part.final_words or []
        if not words and part.index < 0:
            return  # nothing was heard (noise, a cough): no caption
        self._said(part, " ".join(words))
        self._emit(TranscriptionCompleted(part.turn.item_id, part.index, " ".join(words)))

    def _failed(self, part: _Part, error: Exception) -> None:
        part.done = True
        self._finishing.remove(part)
        self._said(part, "")
        self._emit(TranscriptionFailed(part.turn.item_id, part.index, str(error)[:200] or type(error).__name__))

    def _say_held(self, turn: _Turn) -> None:
        turn.confirmed = True
        held, turn.held = turn.held, []
        for part in held:
            self._finishing.append(part)
            self._complete(part)

    def _number(self, part: _Part) -> None:
        if part.index < 0:
            part.index = len(part.turn.transcripts)
            part.turn.transcripts.append(None)

    def _said(self, part: _Part, transcript: str) -> None:
        self._number(part)
        part.turn.transcripts[part.index] = transcript
