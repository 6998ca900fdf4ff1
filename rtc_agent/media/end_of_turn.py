"""The end-of-turn model: Smart Turn v3.2, a trained audio-only turn-completion classifier, and the semantic_vad
policy built on it.

The model file ships in the `pipecat-ai` wheel (BSD-2), a dependency of the project for that file alone: it is
loaded by path, pipecat is never imported (its analyzer class runs a pipeline of its own; docs/turn-taking.md,
"The end-of-turn model").
Where the file is missing, a server left at the default turn detection runs server_vad instead (config.py).
The input is what the model was trained on: Whisper log-mel features (80 bins) of the turn's last 8 s at 16 kHz,
zero-padded at the front, made by transformers' WhisperFeatureExtractor; the output is one sigmoid,
P(the turn is complete).

Beside it, with the server's --last-words (off by default: docs/turn-taking.md, "The last words", says why),
what the turn ends with in words (last_words.py: Moonshine's transcript, once per pause, and a language model's
P(a sentence ends there)): a turn whose words are unfinished ("a table for") is never ended by the early
verdicts, and one whose words could end a sentence is ended by them at a lower P(complete)
(`Eagerness.finished_threshold`).

Scoring runs on a small thread pool, never on the event loop: onnxruntime with one thread per decision, or two
for the decision of a process's only call (WIDE_THREADS), at a lower CPU priority than the rest (SCORING_NICE).
The engine can score turns too, the same file on its GPU for every call at once (engine/step/turn_scoring.py, with
`windows`): with the server's --end-of-turn-on engine every verdict comes from there, and with its default on a GPU
(overflow) those a process asks for while one of its own is under way (`EndOfTurnScorer.local`); the one under
way is then asked of the engine too, and whichever verdict comes first is taken.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

from ..smart_turn import RATE, WINDOW_S, model_installed, model_path, windows
from . import last_words
from .vad import CHUNK_MS, CHUNK_SAMPLES

log = logging.getLogger(__name__)

SCORING_THREADS = 2  # decisions of different calls run side by side, one onnxruntime thread each
# The decision of a media process's only call, while no other decision runs there, splits the model over two
# threads: on the H200 host's cores the model takes 60 ms on one thread and 34 on two (71 ms of CPU in all), and a
# lone caller's verdict came 20 ms sooner, 8 callers' (one a process) 30 ms (`studies/device_loadtest.sh`). With
# more calls a process the host's cores are the limit when their turns end together (16 callers on
# 16 cores had slower verdicts with two threads), so they keep to one thread each.
WIDE_THREADS = 2
LOCAL_AT_ONCE = 1  # with the engine taking the overflow: a process's decisions on its own threads at once
# When many callers' turns end at once their decisions take every core of the host (24 of 60-90 ms of CPU each on
# the H200 machine's 16), and the threads that every caller's answer waits on in turn (the engine's worker, the
# media processes' event loops) got their CPU after them. The scoring threads run at this much higher a nice value:
# the others go first, and the decisions, spread over many cores, lose little (24 turn ends at once, A/B/A on one
# H200 host: first packets 97-104 against 108-122 ms P50, verdicts no later; `studies/device_ab.sh`). Without
# contention it changes nothing.
SCORING_NICE = 5


class EndOfTurnModel:
    """P(turn complete) for the audio of a turn so far (16 kHz mono float32). Thread-safe."""

    def __init__(self, path: Path | None = None) -> None:
        from transformers import WhisperFeatureExtractor

        path = path or model_path()
        self._sessions = {threads: _session(path, threads) for threads in (1, WIDE_THREADS)}
        self._features = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE, chunk_length=WINDOW_S)

    def __call__(self, audio: np.ndarray, threads: int = 1) -> float:
        """`threads`: 1, or WIDE_THREADS (onnxruntime splits the model's work over that many threads)."""
        window = RATE * WINDOW_S
        features = self._features(windows([audio])[0], sampling_rate=RATE, return_tensors="np",
                                  padding="max_length", max_length=window, truncation=True,
                                  do_normalize=True).input_features
        (out,) = self._sessions[threads].run(None, {"input_features": features.astype(np.float32)})
        return float(np.asarray(out).reshape(-1)[0])


def _session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no core kept busy between decisions
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


@dataclasses.dataclass(frozen=True)
class Decision:
    probability: float
    cost_ms: float  # CPU time of this decision on its scoring thread (features + model); threads 0: its batch's time
    threads: int = 1  # onnxruntime threads it ran on (the other's CPU time is not in cost_ms); 0: on the engine


@dataclasses.dataclass(frozen=True)
class Words:
    text: str  # what the turn's audio says, as far as the recogniser heard it
    end_probability: float | None  # P(a sentence ends after it), None: no evidence (last_words.SentenceEnds)
    cost_ms: float  # CPU time of the transcript and the language model on its thread

    @property
    def unfinished(self) -> bool | None:
        """The P is below last_words.UNFINISHED_BELOW (None: no evidence)."""
        return last_words.unfinished(self.end_probability)


EngineScore = Callable[[np.ndarray], Awaitable[tuple[float, float]]]  # Engine.score_turn, RemoteEngine.score_turn


@dataclasses.dataclass(eq=False)
class _LocalAsk:
    """A decision on this process's threads: its audio, and the verdict its caller awaits. Compared by identity:
    the generated __eq__ compared the audio arrays, which raised in `_asked_here.remove` whenever a decision came
    back before one asked earlier, and then every later verdict of the process was lost (its calls' turns ended
    only at semantic_vad's longest wait, 3 s)."""
    audio: np.ndarray
    verdict: asyncio.Future[Decision]
    hedged: bool = False  # asked of the engine too


class EndOfTurnScorer:
    """The process's end-of-turn model, its recogniser of the last words (None: not installed) and the threads
    they run on, shared by every call; and the engine's verdicts, where it scores turns.

    Why the overflow to the engine (`local` 1): when many callers stop at once, each process's decisions queue for
    the host's cores (24 turn ends on the H200 machine's 16 cores: verdicts 130-223 ms P50 against 34-48 for a
    lone caller) and the turns end 60-200 ms later than a lone caller's; the engine scores a batch of them on its
    GPU in a few milliseconds. A lone caller's verdicts stay onnxruntime's, those the thresholds were chosen on.
    When a decision goes to the engine while one of the process's own is under way, that one is asked of the
    engine too and the first verdict back is taken: under such a burst the process's own took 85-108 ms, and its
    turn ended 32-64 ms after the others of the burst; with the hedge every turn of 24 ends at 96 ms of silence
    (docs/turn-taking.md, "Where the verdicts run")."""

    def __init__(self, model: Callable[[np.ndarray, int], float] | None,
                 hear: Callable[[np.ndarray], tuple[str, float | None]] | None = None,
                 engine: EngineScore | None = None, local: int | None = None) -> None:
        """`hear`: a turn's audio -> (its words, P(a sentence ends there)), as last_words.LastWords. `engine`: the
        engine's verdicts, asked for where `local` decisions of this process are already on their way here (None:
        never; 0: always, and `model` may be None)."""
        if (engine is None) != (local is None):
            raise ValueError("the engine's verdicts and `local` go together")
        if model is None and local != 0:
            raise ValueError("a scorer without the model takes every verdict from the engine (local 0)")
        self._model = model
        self._hear = hear
        self._engine = engine
        self.local = local
        self._pool = concurrent.futures.ThreadPoolExecutor(SCORING_THREADS, thread_name_prefix="end-of-turn",
                                                           initializer=lower_priority)
        self._lock = threading.Lock()
        self._running = 0  # decisions running on this process's threads
        self._asked_here: list[_LocalAsk] = []  # decisions asked of this process's threads and still running there
        self.calls = 0  # calls whose turns it scores (SemanticTurn)

    def warm_up(self) -> None:
        """One verdict of this process's model on each of its thread counts, on silence (blocking; at start-up):
        the first run of a session is slower than the rest, and no caller's turn should pay for it."""
        if self._model is not None:
            for threads in (1, WIDE_THREADS):
                self._model(np.zeros(RATE // 2, np.float32), threads)

    def with_engine(self, engine: EngineScore, local: int) -> "EndOfTurnScorer":
        """A scorer with this one's models that takes verdicts from `engine` beyond `local` at once here."""
        return EndOfTurnScorer(self._model, self._hear, engine, local)

    @property
    def hears_words(self) -> bool:
        return self._hear is not None

    def score_now(self, audio: np.ndarray) -> Decision:
        """The verdict of this process's model, on the calling thread."""
        if self._model is None:
            raise RuntimeError("this scorer's verdicts come from the engine: await score()")
        with self._lock:
            threads = WIDE_THREADS if self._running == 0 and self.calls <= 1 else 1
            self._running += 1
        try:
            started = time.thread_time()
            p = self._model(audio, threads)
            return Decision(p, round((time.thread_time() - started) * 1000, 2), threads)
        finally:
            with self._lock:
                self._running -= 1

    async def score(self, audio: np.ndarray) -> Decision:
        """The turn's verdict: on this process's threads, or from the engine (Decision.threads 0)."""
        if self._engine is not None and len(self._asked_here) >= self.local:
            for ask in self._asked_here:
                if not ask.hedged and not ask.verdict.done():
                    self._ask_engine_too(ask)
            return await self._from_engine(audio)
        loop = asyncio.get_running_loop()
        ask = _LocalAsk(audio, loop.create_future())
        self._asked_here.append(ask)
        run = loop.run_in_executor(self._pool, self.score_now, audio)
        run.add_done_callback(functools.partial(self._ran_here, ask))
        return await ask.verdict

    async def _from_engine(self, audio: np.ndarray) -> Decision:
        assert self._engine is not None
        p, ms = await self._engine(np.asarray(audio, np.float32)[-RATE * WINDOW_S:])
        return Decision(p, ms, threads=0)

    def _ask_engine_too(self, ask: _LocalAsk) -> None:
        """The engine's verdict on `ask`'s audio answers it if it comes first; if the engine fails, the run here
        still does."""
        async def engine_verdict() -> None:
            try:
                decision = await self._from_engine(ask.audio)
            except Exception:  # (the run here answers)
                log.debug("the engine's verdict on a turn being scored here failed", exc_info=True)
                return
            if not ask.verdict.done():
                ask.verdict.set_result(decision)

        ask.hedged = True
        task = asyncio.ensure_future(engine_verdict())
        ask.verdict.add_done_callback(lambda _: task.cancel())  # (answered here first: the engine's is not wanted)

    def _ran_here(self, ask: _LocalAsk, run: asyncio.Future[Decision]) -> None:
        self._asked_here.remove(ask)
        if ask.verdict.done():  # (the engine's came first, or the caller stopped waiting)
            if not run.cancelled():
                run.exception()  # (retrieved: a failed run nobody waits for is not an error to report)
            return
        if run.cancelled():
            ask.verdict.cancel()
        elif run.exception() is not None:
            ask.verdict.set_exception(run.exception())
        else:
            ask.verdict.set_result(run.result())

    def words_now(self, audio: np.ndarray) -> Words:
        if self._hear is None:
            raise RuntimeError("no recogniser of the last words is installed")
        started = time.thread_time()
        text, p = self._hear(audio)
        return Words(text, p, round((time.thread_time() - started) * 1000, 2))

    async def words(self, audio: np.ndarray) -> Words:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.words_now, audio)


def lower_priority(by: int = SCORING_NICE) -> None:
    """The calling thread's nice value up by `by`. Linux only: there a thread's id names that thread to
    setpriority (elsewhere it would name a process, or nothing)."""
    if not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + by)
    except OSError:  # (a sandbox that forbids it: the decisions keep the process's priority)
        pass


_shared_lock = threading.Lock()


@functools.cache
def _load_shared(words: bool) -> EndOfTurnScorer:
    return EndOfTurnScorer(EndOfTurnModel(), last_words.shared_last_words() if words else None)


def shared_scorer(words: bool = False) -> EndOfTurnScorer:
    """The process-wide scorer, loaded on first use (a second or so; call it off the event loop). `words`: with
    the last-words check (the server's --last-words; its models must be installed: LastWordsUnavailable)."""
    if words and not last_words.installed():
        raise last_words.LastWordsUnavailable(f"--last-words needs its models: {last_words.INSTALL_HINT}")
    with _shared_lock:
        return _load_shared(words)


def installed_scorer(words: bool = False) -> EndOfTurnScorer | None:
    """The shared scorer, or None where the model is not installed (then only server_vad is offered)."""
    return shared_scorer(words) if model_installed() else None


@dataclasses.dataclass(frozen=True)
class Eagerness:
    """How semantic_vad ends a turn. The early check points are `first_check_ms` of silence, then every
    `recheck_ms` while before `early_until_ms` (auto: 64, 128 and 192 ms); their verdicts end the turn when the
    mean P(complete) of the pause's latest `average_of` verdicts is >= `threshold` + `threshold_per_ms`
    x (silence - first_check_ms), the silence being the one at which the verdict was asked for (one verdict jumps
    by up to 0.3 from one check to the next). An incomplete turn waits: the late check points are `patient_ms`
    of silence, then every `late_recheck_ms`, and their verdicts end it at P >= LATE_THRESHOLD; after
    `max_wait_ms` of silence it ends anyway. Where the last words are heard (last_words.py), an early verdict never
    ends a turn whose words are unfinished, and ends one whose words could end a sentence at P >=
    `finished_threshold` (None: the same threshold as without words).

    One verdict is on its way at a time, and the points do not move with it: a point that passes while a
    verdict is on its way is asked for once that verdict is back, so a slow verdict (a busy CPU) makes the
    checks later, never fewer, and the rising threshold asks a later check for a surer verdict.

    Why the rising threshold and the gap: on the model's scale a longer silence reads as "more complete"
    whatever was said (a sentence cut in its pause scores 0.9 and more after 500 ms of it), so the early
    verdicts must be surer as the silence goes on, and the later ones come after the pauses people make
    inside a sentence (0.6-1 s). The numbers were chosen on the `tuning` speech set (studies/turn_tuning.py)
    and are reported on a held-out set (docs/turn-taking.md)."""

    threshold: float
    first_check_ms: int
    recheck_ms: int
    early_until_ms: int
    patient_ms: int
    late_recheck_ms: int
    max_wait_ms: int
    threshold_per_ms: float = 0.0
    average_of: int = 1
    finished_threshold: float | None = None

    def threshold_at(self, silence_ms: int) -> float:
        """The P(complete) that ends the turn, for a verdict asked for at `silence_ms` of silence."""
        if silence_ms >= self.patient_ms:
            return min(self.threshold, LATE_THRESHOLD)
        return min(self.threshold + self.threshold_per_ms * max(0, silence_ms - self.first_check_ms), 1.0)

    def ends_turn(self, scores: list[float], silence_ms: int, unfinished: bool | None = None) -> bool:
        """Whether the pause's verdicts so far (`scores`, the latest last, asked for at `silence_ms`) end it;
        `unfinished`: what the pause's last words say (None: not heard)."""
        if silence_ms >= self.patient_ms:
            return scores[-1] >= self.threshold_at(silence_ms)
        if unfinished:
            return False
        threshold = self.threshold_at(silence_ms)
        if unfinished is False and self.finished_threshold is not None:
            threshold = self.finished_threshold
        recent = scores[-self.average_of:]
        return len(recent) == self.average_of and sum(recent) / len(recent) >= threshold

    def next_check_ms(self, point_ms: int) -> int:
        """The check point after the one at `point_ms` of silence (whenever its verdict was asked for)."""
        if point_ms + self.recheck_ms < self.early_until_ms:
            return point_ms + self.recheck_ms
        return max(point_ms + self.late_recheck_ms, self.patient_ms)


LATE_THRESHOLD = 0.5
# A verdict ends the turn no sooner than this far into the silence, one chunk after the first check: silero reads
# some short gaps inside a sentence as a silence of exactly 64 ms (`.whl/question.wav`, "What is the weather |
# like in Paris today?", at one chunk phase in six, where Smart Turn says 0.97). A verdict back within 32 ms ended
# the turn there and the answer came over the caller; a slower one came back after speech had resumed and was
# dropped. So whether a caller was cut depended on the CPU's speed.
EARLIEST_END_MS = CHUNK_MS * 3
# Early verdicts chosen on the tuning speech set with studies/turn_tuning.py: auto/medium the fastest keeping at
# least 70 % of its mid-sentence pauses, low 85 %, high 50 % (the late verdicts as before); averaging two
# verdicts (average_of=2) did better offline but worse live on the tuning set. docs/turn-taking.md has them on
# the held-out set.
_LATE = {"patient_ms": 1100, "late_recheck_ms": 480, "max_wait_ms": 3000}
# With the last words heard and able to end a sentence, auto/medium's first early verdict ends the turn whatever it
# says (0.0): on the tuning sets (espeak-ng and flite's four voices, studies/turn_tuning.py --search) the fastest
# policy keeping 80 % of the mid-sentence pauses (docs/turn-taking.md, "The last words"). high and low keep their
# thresholds: the words only hold their early verdicts back.
FINISHED_THRESHOLD = 0.0
EAGERNESS = {
    "high": Eagerness(threshold=0.8, first_check_ms=64, recheck_ms=96, early_until_ms=256,
                      patient_ms=640, late_recheck_ms=320, max_wait_ms=2000),
    "medium": Eagerness(threshold=0.9, threshold_per_ms=0.0002, first_check_ms=64, recheck_ms=64,
                        early_until_ms=256, finished_threshold=FINISHED_THRESHOLD, **_LATE),
    "auto": Eagerness(threshold=0.9, threshold_per_ms=0.0002, first_check_ms=64, recheck_ms=64,
                      early_until_ms=256, finished_threshold=FINISHED_THRESHOLD, **_LATE),
    "low": Eagerness(threshold=0.95, threshold_per_ms=0.0002, first_check_ms=128, recheck_ms=96,
                     early_until_ms=256, patient_ms=1400, late_recheck_ms=640, max_wait_ms=4000),
}


class SemanticTurn:
    """One call's semantic end-of-turn decisions for the turn in progress.

    The conversation hands it the turn's audio (`add`) and, per chunk, the silence run so far (`silence`). At
    the first chunk at or after each check point of a pause (Eagerness) with no verdict on its way, it scores
    the turn on the scorer's threads; a verdict that comes back while the same pause still goes on and says
    "complete" calls `on_complete()`. Speech resuming starts a new pause, and late verdicts of older pauses are
    ignored.
    """

    def __init__(self, scorer: EndOfTurnScorer, eagerness: Eagerness, on_complete: Callable[[], None]) -> None:
        self.scorer = scorer
        scorer.calls += 1
        self._closed = False
        self.eagerness = eagerness
        self._on_complete = on_complete
        self._audio: list[np.ndarray] = []
        self._samples = 0
        self._pause = 0  # which pause a verdict belongs to
        self._silence_ms = 0  # the silence run as of the latest chunk
        self._complete = False  # this pause's verdicts ended the turn before EARLIEST_END_MS: it ends there
        self._next_check_ms = eagerness.first_check_ms
        self._scoring = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.probability: float | None = None  # the latest verdict of this turn
        self.decisions: list[Decision] = []
        self.checked_at_ms: int | None = None  # the silence at which the latest verdict was asked for
        self.verdict_ms: float | None = None  # how long it took to come back (thread pool queue included)
        self.words: Words | None = None  # the latest pause's last words, once heard
        self._words: asyncio.Task[Words] | None = None  # the pause's transcript on its way (one per pause)

    def start(self, chunks: list[np.ndarray]) -> None:
        """A new turn, with its first audio (pre-roll included)."""
        self._audio, self._samples = [], 0
        self.probability, self.decisions = None, []
        self.checked_at_ms, self.verdict_ms = None, None
        self.words = None
        self._new_pause()
        self.add(chunks)

    def add(self, chunks: list[np.ndarray]) -> None:
        self._audio.extend(chunks)
        self._samples += sum(len(c) for c in chunks)
        keep = RATE * WINDOW_S + CHUNK_SAMPLES
        while self._audio and self._samples - len(self._audio[0]) >= keep:
            self._samples -= len(self._audio.pop(0))

    def silence(self, silence_ms: int) -> None:
        """The silence run after the turn's speech, as of the latest chunk (0: the caller is speaking)."""
        self._silence_ms = silence_ms
        if silence_ms == 0:
            if self._next_check_ms != self.eagerness.first_check_ms or self._complete:
                self._new_pause()
            return
        if self._complete and silence_ms >= EARLIEST_END_MS:  # a verdict said so before EARLIEST_END_MS
            self._complete = False
            self._on_complete()
            return
        if silence_ms >= self._next_check_ms and not self._scoring and self._audio:
            self._next_check_ms = self.eagerness.next_check_ms(self._next_check_ms)
            self._scoring = True
            audio = np.concatenate(self._audio)
            if self._words is None and self.scorer.hears_words:  # the words do not change while the pause lasts
                self._words = self._spawn(self.scorer.words(audio))
            self._spawn(self._score(self._pause, audio, silence_ms))

    def stop(self) -> None:
        """The turn is over (or abandoned): verdicts still on their way are ignored."""
        self._new_pause()

    def close(self) -> None:
        self.stop()
        if not self._closed:
            self._closed = True
            self.scorer.calls -= 1
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _new_pause(self) -> None:
        self._pause += 1
        self._words = None
        self._next_check_ms = self.eagerness.first_check_ms
        self._pause_scores: list[float] = []  # this pause's verdicts
        self._scoring = False  # a verdict still on its way belongs to the old pause
        self._complete = False

    async def _score(self, pause: int, audio: np.ndarray, silence_ms: int) -> None:
        asked, words = time.monotonic(), self._words
        try:
            decision = await self.scorer.score(audio)
            heard = await words if words is not None else None  # (asked for with the pause's first verdict)
        finally:
            if pause == self._pause:
                self._scoring = False
        if pause != self._pause:
            return
        self.probability = decision.probability
        self.decisions.append(decision)
        self.checked_at_ms, self.verdict_ms = silence_ms, round((time.monotonic() - asked) * 1000, 1)
        self.words = heard
        self._pause_scores.append(decision.probability)
        if self.eagerness.ends_turn(self._pause_scores, silence_ms, heard.unfinished if heard else None):
            if self._silence_ms >= EARLIEST_END_MS:
                self._on_complete()
            else:
                self._complete = True
