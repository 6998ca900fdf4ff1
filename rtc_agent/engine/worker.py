"""The engine's worker: the one thread that runs every piece of torch work, and the scheduler that decides what
goes next.

Two kinds of work reach it. Jobs are what a session asks for (a prefill chunk of caller audio, a video frame, the
start of an answer, a reset); they run one at a time, urgent ones (an answer's start: a caller is waiting for the
first packet) before the rest, each kind in the order asked. Answers in progress advance together, one batched
step (`answer.tick`) for all of them at a time. Between two steps jobs run for up to `JOB_SLICE_S` (most jobs, a
piece of caller audio, take well under a millisecond; a prefill takes tens), and for as long as every answer is at
least `MIN_LEAD_S` of speech ahead of its playout; an answer closer to its deadline gets the next step first, so
a caller listening to an answer never hears a late frame because another caller started talking, while the
callers who are talking still have their audio taken in.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from .answer import Answer
from .memory import EngineOutOfMemory

log = logging.getLogger(__name__)

URGENT, NORMAL = 0, 1
MIN_LEAD_S = 0.24  # three frames: below this an answer's next frame goes before any job
JOB_SLICE_S = 0.01  # job time between two steps even when an answer is close to its deadline


class Worker:
    def __init__(self, name: str, step: Callable[[list[Answer]], None]) -> None:
        self._step = step
        self._jobs: list[tuple[int, int, Callable[[], Any], Future]] = []
        self._order = itertools.count()
        self._answers: list[Answer] = []  # touched on the worker thread only
        self._slice_spent = 0.0  # job time since the last step
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], priority: int = NORMAL) -> Future:
        """Run `fn()` on the worker (under inference mode); the future holds its result."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            heapq.heappush(self._jobs, (priority, next(self._order), fn, future))
            self._wake.notify()
        return future

    def add(self, answer: Answer) -> None:
        """Start stepping `answer` (call on the worker, from a job)."""
        self._answers.append(answer)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for *_, future in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._wake.notify()

    def _next(self) -> tuple[Callable[[], Any], Future] | None:
        """The next job, or None for a step of the answers (waits while there is nothing to do)."""
        with self._wake:
            while True:
                if self._closed:
                    raise _Closed
                if self._jobs:
                    now = time.perf_counter()
                    lead = min((a.lead_s(now) for a in self._answers), default=MIN_LEAD_S)
                    if self._jobs[0][0] == URGENT or lead >= MIN_LEAD_S or self._slice_spent < JOB_SLICE_S:
                        *_, fn, future = heapq.heappop(self._jobs)
                        return fn, future
                if self._answers:
                    return None
                self._wake.wait()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                try:
                    job = self._next()
                except _Closed:
                    return
                if job is None:
                    self._advance()
                    self._slice_spent = 0.0
                    continue
                fn, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                started = time.perf_counter()
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001  (handed to whoever waits for the job)
                    future.set_exception(exc)
                self._slice_spent += time.perf_counter() - started

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
                            answer.conversation.recover()
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


class _Closed(Exception):
    pass
