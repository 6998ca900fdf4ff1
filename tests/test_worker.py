"""The engine worker's scheduling, with plain work in place of torch: which job or step runs when.

The answers here are `Behind` objects, answers that are always short of speech (as a new answer is), so a step is
due whenever the job slice is spent; the rounds are plain functions. The real engine's steps and rounds are
covered by the engine tests; these pin the order the worker gives them."""
from __future__ import annotations

import threading
import time
from collections.abc import Generator

from rtc_agent.engine.scheduler.policy import CRITICAL_LEAD_S, JOB_SLICE_S, MIN_LEAD_S, NORMAL, URGENT
from rtc_agent.engine.scheduler.worker import Worker


class Behind:
    """An answer past its first frame with `lead` seconds of speech ahead of its playout, always: with less than
    MIN_LEAD_S the worker steps it whenever a step may run, with less than CRITICAL_LEAD_S inside rounds too."""

    done = False
    after: list = []
    first_frame_at = 0.0

    def __init__(self, lead: float = 0.0) -> None:
        self.lead = lead

    def lead_s(self, now: float) -> float:
        return self.lead


def _worker(log: list[str], stage_of=lambda request: 0) -> Worker:
    def step(answers: list) -> None:
        log.append("step")

    def run_requests(requests: list[str]) -> list[str]:
        log.append("round " + " ".join(requests))
        return requests

    return Worker("test-worker", step, run_requests, stage_of=stage_of)


def _queued_behind_an_answer(worker: Worker, submit, lead: float = 0.0) -> list:
    """`submit()` queues jobs (returns their futures) while a first job holds the worker, having started an answer
    short of speech (`Behind(lead)`: steps are due from then on); returns the jobs' results, and closes the
    worker."""
    holding, gate = threading.Event(), threading.Event()
    try:
        first = worker.submit(lambda: (worker.add(Behind(lead)), holding.set(), gate.wait(5)), NORMAL)
        assert holding.wait(5)
        jobs = submit()
        gate.set()
        first.result(5)
        return [job.result(5) for job in jobs]
    finally:
        worker.close()


def _turn_end(log: list[str], name: str) -> Generator[str, str, str]:
    """A session's turn work: one request, then host work longer than a job slice (an answer's first token)."""
    yield name
    time.sleep(JOB_SLICE_S * 1.5)
    log.append(f"{name} done")
    return name


def test_a_due_step_waits_until_every_session_of_the_round_is_resumed():
    log: list[str] = []
    worker = _worker(log)
    # three sessions' turn ends queued behind the answer's start go into one round
    assert _queued_behind_an_answer(worker, lambda: [
        worker.submit(lambda n=n: _turn_end(log, n), URGENT, key=n) for n in ("a", "b", "c")]) == ["a", "b", "c"]
    round_at = log.index("round a b c")
    assert log[round_at + 1:round_at + 4] == ["a done", "b done", "c done"], log


def test_an_urgent_job_takes_its_sessions_queued_jobs_with_it():
    """A session's audio sent just before its preparation, which the media side did not wait for: the preparation
    (urgent) does not overtake it, and neither waits behind other sessions' ordinary work."""
    log: list[str] = []
    worker = _worker(log)
    holding, gate = threading.Event(), threading.Event()
    try:
        first = worker.submit(lambda: (holding.set(), gate.wait(5)), NORMAL)
        assert holding.wait(5)
        jobs = [worker.submit(lambda: log.append("b audio"), NORMAL, key="b"),
                worker.submit(lambda: log.append("a audio"), NORMAL, key="a"),
                worker.submit(lambda: log.append("a prepares"), URGENT, key="a")]
        gate.set()
        first.result(5)
        for job in jobs:
            job.result(5)
    finally:
        worker.close()
    assert log == ["a audio", "a prepares", "b audio"]


def _staged(name: str, stages: list[int]) -> Generator[str, str, str]:
    """A session's turn work whose requests belong to `stages` in turn (a request is `name` + its stage), each
    followed by host work longer than a job slice, so that a step is due after every piece of it."""
    for stage in stages:
        yield f"{name}{stage}"
        time.sleep(JOB_SLICE_S * 1.5)
    return name


def _two_staged_turn_ends(lead: float) -> list[str]:
    """The log of two sessions' staged turn ends queued behind an answer `lead` seconds ahead of its playout."""
    log: list[str] = []
    worker = _worker(log, stage_of=lambda request: int(request[-1]))
    assert _queued_behind_an_answer(worker, lambda: [
        worker.submit(lambda: _staged("a", [0, 1, 2]), URGENT, key="a"),
        worker.submit(lambda: _staged("b", [0, 1, 0]), URGENT, key="b")], lead) == ["a", "b"]
    return log[log.index("round a0 b0"):]


def test_a_jobs_requests_of_later_stages_go_on_in_the_same_round():
    """Stages 0, 1, 2 (audio, Thinker prefill, Talker prefill): a turn end's three requests run in one round, with
    no step between them though steps are due; a job whose next request is of an earlier stage (its next chunk's
    audio) waits for the next round, after the step."""
    log = _two_staged_turn_ends(lead=(CRITICAL_LEAD_S + MIN_LEAD_S) / 2)
    assert log[:5] == ["round a0 b0", "round a1 b1", "round a2", "step", "round b0"], log


def test_an_answer_about_to_run_out_of_speech_is_stepped_between_the_stages_of_a_round():
    """The same, with the answer less than CRITICAL_LEAD_S ahead: one step before each later stage of the round
    (its next frame would otherwise come late), and the round still goes on."""
    log = _two_staged_turn_ends(lead=0.0)
    assert log[:7] == ["round a0 b0", "step", "round a1 b1", "step", "round a2", "step", "round b0"], log


def test_a_due_step_goes_between_one_urgent_jobs_round_and_the_next():
    """Urgent jobs of one session, one round each, back to back while an answer is short of speech: a step runs
    between their rounds (an urgent job goes before a due step, but not its round)."""
    log: list[str] = []
    worker = _worker(log)
    _queued_behind_an_answer(worker, lambda: [
        worker.submit(lambda n=n: _staged(n, [0]), URGENT, key="x") for n in ("a", "b")])
    start = log.index("round a0")
    assert log[start:start + 3] == ["round a0", "step", "round b0"], log


def test_an_urgent_job_that_comes_during_a_round_catches_up_with_it():
    """A turn end submitted while the round of an earlier one runs its first stage: its first request runs next
    (an earlier stage than the round's), and from there both go on together, instead of one whole round after the
    other (a burst of callers whose audio came a few ms apart)."""
    log: list[str] = []
    worker: Worker

    def run_requests(requests: list[str]) -> list[str]:
        log.append("round " + " ".join(requests))
        if requests == ["a0"]:
            jobs.append(worker.submit(lambda: _staged("b", [0, 1, 2]), URGENT, key="b"))
        return requests

    jobs: list = []
    worker = Worker("test-worker", lambda answers: None, run_requests, stage_of=lambda request: int(request[-1]))
    try:
        jobs.append(worker.submit(lambda: _staged("a", [0, 1, 2]), URGENT, key="a"))
        assert jobs[0].result(5) == "a"
        assert jobs[1].result(5) == "b"
    finally:
        worker.close()
    assert log == ["round a0", "round b0", "round a1 b1", "round a2 b2"], log


def test_a_sessions_next_urgent_job_starts_as_soon_as_its_job_in_the_round_is_done():
    """An answer asked for while its preparation runs the round's last stage starts right after that session's
    preparation ends, before the other sessions of the stage are resumed, not at the round's end."""
    log: list[str] = []
    worker: Worker

    def run_requests(requests: list[str]) -> list[str]:
        log.append("round " + " ".join(requests))
        jobs.append(worker.submit(lambda: log.append("a begins"), URGENT, key="a"))
        return requests

    def prepare(name: str) -> Generator[str, str, str]:
        yield name
        log.append(f"{name} done")
        return name

    jobs: list = []
    worker = Worker("test-worker", lambda answers: None, run_requests)
    try:
        with worker.held():  # both preparations in one round
            jobs += [worker.submit(lambda n=n: prepare(n), URGENT, key=n) for n in ("a", "b")]
        assert [job.result(5) for job in jobs[:2]] == ["a", "b"]
        jobs[2].result(5)
    finally:
        worker.close()
    assert log == ["round a b", "a done", "a begins", "b done"], log
