"""The engine's worker: the one thread that runs every piece of torch work, and the scheduler that decides what
goes next.

Two kinds of work reach it. Jobs are what a session asks for (a prefill chunk of caller audio, a video frame, the
start of an answer, a reset); they run one at a time, urgent ones (an answer's start or preparation, and the caller
audio just before a preparation: a caller is waiting for the first packet) before the rest, each kind in the order
asked. Answers in progress advance together, one batched step (`answer.tick`) for all of them at a time. Between two
steps jobs run for up to `JOB_SLICE_S` (most jobs, a piece of caller audio, take well under a millisecond; a
prefill takes tens), and for as long as every answer is at least `MIN_LEAD_S` of speech ahead of its playout; an
answer closer to its deadline gets the next step first, so a caller listening to an answer never hears a late frame
because another caller started talking, while the callers who are talking still have their audio taken in.

A job may be a generator (a session's turn work, see `CallContext`): it yields requests (audio to encode, a short
Thinker or Talker prefill, an answer's first token). The worker then starts every queued job of the other sessions
too, up to their first request, and runs all the requests as one round, stage by stage (`run_requests` per stage:
one pass of the audio encoder, one batched Thinker prefill, one draw of first tokens, one batched Talker prefill,
one batched step for the first frames of prepared answers);
a job whose next request belongs to a later stage goes on in the same round. Rounds follow each other until the
jobs are done. Eight callers who end their turns at the same moment so cost about one turn end's launches and
weight reads instead of eight. Within a round, between one session's rest of the work and the next (host work:
its next request's inputs), urgent jobs that came meanwhile join: a prepared answer starts at once, and a turn
end that came a few ms after the round's first catches up with it from its own first stage; a due
step runs before each round, never inside one, so that no session's finished request waits for a step behind
another's (only an answer about to run out of speech gets a step between two stages of a round). A session's jobs
keep their order: a job waits while an earlier one of the same session (its `key`) is in a round.

`RTC_AGENT_WORKER_TRACE=path` writes one JSON line per job submitted, started and done, per piece of a job's host
work, per round and per step to `path.<pid>` (docs/performance.md reads such a trace): the way to see where a slow
first packet waited.
"""
from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.memory import EngineOutOfMemory
from ..step.answer import Answer
from .policy import CRITICAL_LEAD_S, JOB_SLICE_S, MIN_LEAD_S, NORMAL, URGENT

log = logging.getLogger(__name__)


@dataclass(order=True)
class _Job:
    priority: int
    order: int
    fn: Callable[[], Any] = field(compare=False)
    future: Future = field(compare=False)
    key: Any = field(compare=False)  # the session it belongs to (None: none)


@dataclass
class _Waiting:
    """A generator job waiting for its request to run."""

    job: _Job
    work: Generator[Any, Any, Any]
    request: Any


class _Trace:
    """RTC_AGENT_WORKER_TRACE=path: one JSON line per scheduling event, `t` in ms of time.perf_counter(). The file
    is opened at the first event, so that only a process with an engine writes one.

    On a GPU each round and step also gets a `gpu` line once the GPU has done it: `ms` from its first to its last
    kernel on the worker's stream (CUDA events, read without waiting), `n` the number of its `round` or `step`
    line. A round's own `ms` is only the time to queue its work; the gap to the next round is the sessions' host
    work and what it waits for on the GPU, which this tells apart."""

    def __init__(self) -> None:
        self._path = os.environ.get("RTC_AGENT_WORKER_TRACE")
        self.on = bool(self._path)
        self._file: Any = None
        self._count = itertools.count(1)
        self._timed: list[tuple[int, Any, Any]] = []  # (n, start event, end event) not yet done on the GPU

    def __call__(self, **record: Any) -> None:
        if self.on:
            if self._file is None:
                self._file = open(f"{self._path}.{os.getpid()}", "w", buffering=1)
            record["t"] = round(time.perf_counter() * 1000, 2)
            self._file.write(json.dumps(record) + "\n")
            self._gpu_done()

    def gpu_start(self) -> Any:
        """An event on the current stream before a round's or step's work (None off the GPU)."""
        if not (self.on and torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def timed(self, start: Any, **record: Any) -> None:
        """Write `record` (a round or a step, numbered `n`), and its `gpu` line once the GPU is past its work."""
        record["n"] = n = next(self._count)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timed.append((n, start, end))
        self(**record)

    def _gpu_done(self) -> None:
        while self._timed and self._timed[0][2].query():
            n, start, end = self._timed.pop(0)
            self._file.write(json.dumps({"e": "gpu", "n": n, "ms": round(start.elapsed_time(end), 2),
                                         "t": round(time.perf_counter() * 1000, 2)}) + "\n")


TRACE = _Trace()


class Worker:
    def __init__(self, name: str, step: Callable[[list[Answer]], None],
                 run_requests: Callable[[list[Any]], list[Any]], stage_of: Callable[[Any], int] = lambda _: 0,
                 threads: int = 1) -> None:
        """`run_requests`: runs the generator jobs' requests of one stage of a round, results in order;
        `stage_of(request)`: its stage (a round runs its stages in increasing order). `threads`: torch's intra-op
        threads for this thread's own CPU work."""
        self._step = step
        self._threads = threads
        self._run_requests = run_requests
        self._stage_of = stage_of
        self._jobs: list[_Job] = []
        self._order = itertools.count()
        self._answers: list[Answer] = []  # touched on the worker thread only
        self._slice_spent = 0.0  # job time since the last step
        self._mark = time.perf_counter()  # when job time was last counted into the slice
        self._wake = threading.Condition()
        self._held = 0  # open `held()` blocks: jobs wait
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], priority: int = NORMAL, key: Any = None) -> Future:
        """Run `fn()` on the worker (under inference mode); the future holds its result (a generator's return
        value, for a generator job). `key`: the session the job belongs to (its jobs run in order: an urgent job
        makes that session's jobs still queued urgent too, `_expedite`)."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if priority == URGENT and key is not None:
                self._expedite(key)
            heapq.heappush(self._jobs, _Job(priority, next(self._order), fn, future, key))
            TRACE(e="submit", key=key, p=priority, name=getattr(fn, "__name__", "?"))
            self._wake.notify()
        return future

    def _expedite(self, key: Any) -> None:
        """(With `_wake` held.) The jobs of session `key` still queued become urgent, in their order: an urgent job
        of that session (the answer's preparation, its caller having paused) follows them, and would otherwise
        wait for them behind other sessions' ordinary work, or go before them."""
        raised = [job for job in self._jobs if job.key == key and job.priority != URGENT]
        for job in raised:
            job.priority = URGENT
        if raised:
            heapq.heapify(self._jobs)
            TRACE(e="expedite", key=key, jobs=len(raised))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Jobs submitted inside the block wait for its end, then start together: generator jobs of different
        sessions in one round (the warm-up's turn ends of many rows at once). Answers in progress go on."""
        with self._wake:
            self._held += 1
        try:
            yield
        finally:
            with self._wake:
                self._held -= 1
                self._wake.notify()

    def add(self, answer: Answer) -> None:
        """Start stepping `answer` (call on the worker, from a job)."""
        self._answers.append(answer)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for job in self._jobs:
                job.future.cancel()
            self._jobs.clear()
            self._wake.notify()

    def _next(self) -> _Job | None:
        """The next job, or None for a step of the answers (waits while there is nothing to do)."""
        with self._wake:
            while True:
                if self._closed:
                    raise _Closed
                if self._jobs and not self._held:
                    if self._jobs[0].priority == URGENT or not self._step_due():
                        return heapq.heappop(self._jobs)
                if self._answers:
                    return None
                self._wake.wait()

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def _step_due(self) -> bool:
        """Whether an answer is so close to its playout that its next frame goes before more jobs' rounds.
        (Not sooner for an answer just started: on the H200 with 24 answers speaking, its first frame out before
        a round of other calls' turn ends left it 80 ms of lead for that round and the next step, 115 ms, and
        2-12 frames a run came late.)"""
        lead = min((a.lead_s(time.perf_counter()) for a in self._answers), default=MIN_LEAD_S)
        return lead < MIN_LEAD_S and self._slice_spent >= JOB_SLICE_S

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)  # (per thread: the event loop's thread keeps its own)
        with torch.inference_mode():
            while True:
                try:
                    job = self._next()
                except _Closed:
                    return
                if job is None:
                    self._step_answers()
                    continue
                self._mark = time.perf_counter()
                waiting: dict[Any, _Waiting] = {}
                self._start(job, waiting)
                while waiting:  # rounds, until every generator job taken in is done; a due step before each
                    self._join(waiting, job.priority)
                    self._step_if_due()
                    self._round(waiting)
                self._charge()

    def _charge(self) -> None:
        """Count the job time since the last mark against the slice."""
        now = time.perf_counter()
        self._slice_spent += now - self._mark
        self._mark = now

    def _step_if_due(self) -> None:
        self._charge()
        if self._answers and self._step_due():
            self._step_answers()

    def _running_short(self) -> bool:
        """Whether an answer already playing has less than CRITICAL_LEAD_S of speech ahead of its playout."""
        now = time.perf_counter()
        return any(a.first_frame_at is not None and a.lead_s(now) < CRITICAL_LEAD_S for a in self._answers)

    def _step_answers(self) -> None:
        started = time.perf_counter()
        lead = min((a.lead_s(started) for a in self._answers), default=None) if TRACE.on else None
        gpu = TRACE.gpu_start()
        self._advance()
        if TRACE.on:
            TRACE.timed(gpu, e="step", ms=round((time.perf_counter() - started) * 1000, 2), answers=len(self._answers),
                        lead_ms=None if lead is None else round(lead * 1000, 1),
                        slice_ms=round(self._slice_spent * 1000, 1))
        self._slice_spent = 0.0
        self._mark = time.perf_counter()

    def _start(self, job: _Job, waiting: dict[Any, _Waiting]) -> None:
        """Run `job` up to its first request (then it waits in `waiting`), or to its end."""
        if not job.future.set_running_or_notify_cancel():
            return
        TRACE(e="start", key=job.key, p=job.priority, name=getattr(job.fn, "__name__", "?"))
        try:
            started = time.perf_counter()
            result = job.fn()
            if inspect.isgenerator(result):
                self._resume(job, result, None, waiting, started=started)
            else:
                TRACE(e="done", key=job.key)
                job.future.set_result(result)
        except BaseException as exc:  # noqa: BLE001  (handed to whoever waits for the job)
            TRACE(e="done", key=job.key, failed=True)
            job.future.set_exception(exc)

    def _resume(self, job: _Job, work: Generator, sent: Any, waiting: dict[Any, _Waiting],
                error: BaseException | None = None, started: float | None = None) -> None:
        """Send `work` the result of its request (or throw `error` in); it waits again or is done. The trace gets
        a `host` line: how long this piece of the job ran on the worker (host work, and waits for the GPU where
        it reads a result back), up to which request (`until`)."""
        started = time.perf_counter() if started is None else started
        until = "done"
        try:
            request = work.throw(error) if error is not None else work.send(sent)
        except StopIteration as stop:
            TRACE(e="done", key=job.key)
            job.future.set_result(stop.value)
        except BaseException as exc:  # noqa: BLE001
            TRACE(e="done", key=job.key, failed=True)
            job.future.set_exception(exc)
        else:
            until = type(request).__name__
            waiting[_slot(job)] = _Waiting(job, work, request)
        if TRACE.on:
            TRACE(e="host", key=job.key, name=getattr(job.fn, "__name__", "?"), until=until,
                  ms=round((time.perf_counter() - started) * 1000, 2))

    def _join(self, waiting: dict[Any, _Waiting], priority: int, busy: set = frozenset()) -> None:
        """Start the queued jobs of sessions with no job in the round (each session's first only; `busy`: more
        sessions to leave out, those of a stage not yet resumed), in order; in a round of urgent jobs (answer
        starts), only urgent ones: a caller's answer never waits for others' audio. None while `held()`."""
        with self._wake:
            if self._held:
                return
            taken, seen = [], set(waiting) | busy
            for job in sorted(self._jobs):
                if job.key is None or job.key in seen:
                    continue
                seen.add(job.key)
                if job.priority <= priority:
                    taken.append(job)
            if taken:
                self._jobs = [job for job in self._jobs if job not in taken]
                heapq.heapify(self._jobs)
        for job in taken:
            self._start(job, waiting)

    def _round(self, waiting: dict[Any, _Waiting]) -> None:
        """One round of every waiting request, stage by stage; each job goes on to its next request or its end.
        A job whose next request belongs to a later stage goes on within the round: a turn end's audio, Thinker
        prefill and Talker prefill take one round, with no step of the answers between them (with 24 answers
        speaking, each step that came between them cost a preparation 55-70 ms of GPU time on the H200), unless an
        answer that is playing would otherwise run out of speech before the round's end (CRITICAL_LEAD_S).

        Jobs that join during a round (urgent ones, between two sessions' resumptions) catch up: their first
        request runs even where its stage is earlier than the round's, and from the round's stage on they go with
        it. In a burst of 24 turn ends whose audio came over 20 ms, the round started by the first 2 held the other
        22 for its whole length (65 ms on the H200) before their own round could start."""
        done, ran = -1, set()  # the last stage run; the jobs that have run a stage in this round (their `order`)
        while True:
            stages = {key: self._stage_of(entry.request) for key, entry in waiting.items()}
            ready = {key: stage for key, stage in stages.items()
                     if stage > done or waiting[key].job.order not in ran}
            if not ready:
                return
            if done >= 0 and self._running_short():  # (one step at most between two stages: the round goes on)
                self._step_answers()
            done = min(ready.values())
            entries = [waiting.pop(key) for key, stage in ready.items() if stage == done]
            ran.update(entry.job.order for entry in entries)
            self._run_stage(entries, waiting)

    def _run_stage(self, entries: list[_Waiting], waiting: dict[Any, _Waiting]) -> None:
        """Run `entries`' requests (one stage of a round) and resume their jobs; they wait again in `waiting`."""
        started = time.perf_counter()
        try:
            gpu = TRACE.gpu_start()
            results = self._run_requests([entry.request for entry in entries])
            if TRACE.on:
                TRACE.timed(gpu, e="round", ms=round((time.perf_counter() - started) * 1000, 2),
                            keys=[entry.job.key for entry in entries], p=[entry.job.priority for entry in entries],
                            kinds=[type(entry.request).__name__ for entry in entries])
        except Exception as exc:  # noqa: BLE001  (each job's own handler sees the error)
            for entry in entries:
                self._resume(entry.job, entry.work, None, waiting, error=exc)
            return
        for n, (entry, result) in enumerate(zip(entries, results)):
            self._resume(entry.job, entry.work, result, waiting)
            # Between one session's rest of the round (host work up to its next request) and the next, answer
            # starts that came meanwhile join (a prepared answer starts at once), the session's own too once its
            # job is done (an answer asked for while it was being prepared starts as soon as it is ready). A due
            # step waits for the round's end: stepping here held every session after this one back by a whole
            # step (at 24 callers, 50-90 ms once per session resumed), for work the GPU had already done.
            self._join(waiting, URGENT, {later.job.key for later in entries[n + 1:]})

    def _advance(self) -> None:
        try:
            self._step(self._answers)
        except Exception as exc:  # noqa: BLE001  (every answer of the failed step ends with the error)
            log.exception("an engine step failed")
            if isinstance(exc, torch.OutOfMemoryError):  # the answers are cut; their calls go on
                exc = EngineOutOfMemory("the GPU ran out of memory while making the answer; it was cut (the call "
                                        "goes on)")
            for answer in self._answers:
                if not answer.done:
                    answer.emit(exc)
                    answer.interrupt(answer.frames)
                    try:  # leave its caches consistent for the session's next turn
                        answer.finish()
                    except Exception:  # noqa: BLE001
                        answer.done = True
                        try:  # its caches may hold half an answer: prefill them again from what is kept
                            answer.context.recover()
                        except Exception:  # noqa: BLE001
                            log.exception("a failed answer's context could not be restored")
        running = []
        for answer in self._answers:
            if not answer.done:
                running.append(answer)
                continue
            for callback in answer.after:
                callback()
        self._answers = running


def _slot(job: _Job) -> Any:
    """A waiting job's place in a round: its session (one job each), or the job itself."""
    return job.key if job.key is not None else id(job)


class _Closed(Exception):
    pass
