"""The suite on two pytest-xdist workers (pyproject's addopts), the second at idle CPU priority.

Most of the suite makes real-time calls: audio paced by the clock, answer frames due every 80 ms, servers of
several processes. Two of them at once on two cores make each other's frames late, so every test outside
tests/offline/ runs on the first worker, one after another in collection order, as in one process. The tests in
tests/offline/ (engine, kernel, recogniser and lint tests that read no clock and make no call) run on the second
worker under SCHED_IDLE: they take only the CPU time the calls leave idle (about one core of two on average here),
so they cost the calls nothing and the run little. `pytest -n 0` runs everything in one process.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

OFFLINE = "tests/offline/"
BACKGROUND_WORKER = "gw1"


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", {}).get("workerid") == BACKGROUND_WORKER:
        run_in_idle_time()


def run_in_idle_time() -> None:
    """This process and what it starts from here on (torch's threads, the engine's worker, subprocesses) at idle
    priority. Where the kernel groups scheduling by session (autogroup), the CPU is shared between sessions
    first, and the servers the calls start run in sessions of their own: so this process takes a session of its
    own too, at the lowest weight (nice 19). SCHED_IDLE alone left the browser tests 20 % slower."""
    with contextlib.suppress(OSError):
        os.setsid()
        Path("/proc/self/autogroup").write_text("19")
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The installed-wheel tests' build (a wheel and a venv, about 75 s of pip) starts with the run, at idle
    priority, so that it is ready when they come (test_package.Build)."""
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker != BACKGROUND_WORKER and any(item.path.name == "test_package.py" for item in session.items):
        import test_package

        test_package.start_build()


@pytest.hookimpl(optionalhook=True)  # (xdist may be left out: -p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling:
    return OfflineBesideScheduling(config, log)


class OfflineBesideScheduling(LoadScopeScheduling):
    """tests/offline/ as one unit for the background worker; every other test a unit of its own for the others, in
    collection order (with one foreground worker, a file's module fixtures are made once). A foreground worker
    takes the offline unit only when the background worker is not there to take it."""

    def _split_scope(self, nodeid: str) -> str:
        return OFFLINE if nodeid.startswith(OFFLINE) else nodeid

    def _pick(self, node) -> str | None:
        if node.gateway.id == BACKGROUND_WORKER:
            return OFFLINE if OFFLINE in self.workqueue else None
        calls = [scope for scope in self.workqueue if scope != OFFLINE]
        if calls:
            return calls[0]
        background_up = any(n.gateway.id == BACKGROUND_WORKER and not n.shutting_down for n in self.nodes)
        return OFFLINE if OFFLINE in self.workqueue and not background_up else None

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is None:
            if not self._pending_of(self.assigned_work.get(node, {})):
                node.shutdown()
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
