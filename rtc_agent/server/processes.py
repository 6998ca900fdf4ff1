"""`rtc-agent serve` as processes by role, the way large serving stacks split an API front from an engine core:

- the engine process: the model, its slots, the scheduler and the CUDA worker, serving sessions on a Unix socket
  (engine/ipc/host.py) and doing nothing else;
- media processes: the calls (aiortc peers, Opus in and out, resampling, VAD, end-of-turn scoring, the
  conversation, the data channel), each an ordinary server (app.py) whose engine is the engine process
  (engine/ipc/remote.py), several calls each;
- the front (front.py): the public port, routing each request to the media process that holds its call.

One Python process cannot feed a GPU: every call's per-packet work and the engine's kernel launches share one GIL
(H200, 16 callers: the event loop 34 ms late on average). Here each has its own. A media process that dies takes
only its calls with it: the engine closes their sessions (their slots come back) and a new media process takes
its place. If the engine process dies, the front stays up and answers 503, and /readyz says why.

CPU priorities, where the user may raise them (root or CAP_SYS_NICE; else everything runs at the normal one): the
engine process runs above the media processes and they above the rest of the machine (nice -10 and -5), since
every call's next frame waits on the engine and a call's packets on its media process; a media process started
again while calls go on does its start-up (4 s of one core on a 2-core machine: Python, torch, aiortc) at +10,
then takes its -5. On a slow 2-core machine (tiny model), a caller's answer during such a restart had 7 and 10 of
its 50 frames late at the normal priorities, 0-4 in 9 runs with these (tests/test_processes.py).

The sockets live in a private directory (0700) made at start-up and removed at the end.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from aiohttp import web

from ..cli import configure_logging
from ..config import Settings
from . import tls
from .front import Front, MediaProcess
from .guard import SETTINGS, api_guard
from .limits import Runner, rate_limit_logging

log = logging.getLogger("rtc_agent.server")
WATCH_S = 0.5
STOP_S = 10.0  # how long a process may take to end after it is told to, before it is killed
ENGINE_WAIT_S = 24 * 3600.0  # a real checkpoint may load for many minutes; a process that dies ends the wait
CRASH_LOOP_S = 30.0  # a media process that dies this soon after its start is started again only this much later
# Nice values, where they may be set (see above)
ENGINE_NICE = -10  # the engine process
MEDIA_NICE = -5  # a media process
RESTART_NICE = 10  # a media process starting again next to live calls, until it has connected to the engine


def media_process_count(settings: Settings) -> int:
    """--media-processes, or for -1 (auto): none on a CPU (one process, the simplest for the tiny model), else one
    per core left after the engine's two and the front's, at most 8."""
    if settings.media_processes >= 0:
        return settings.media_processes
    device = settings.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return 0
    return max(1, min(8, (os.cpu_count() or 4) - 3))


# ---- the processes' mains (run in spawned processes: their arguments are pickled) ------------------------------
async def _orphaned() -> None:
    """Returns when the front that started this process is gone (killed without a word): then this one ends too."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)


def _set_nice(value: int) -> bool:
    """The nice value of this process's threads (Linux keeps one per thread; a new thread takes its creator's);
    False where a value below the current one is not allowed."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    try:
        for task in tasks:
            with contextlib.suppress(ProcessLookupError):  # (a thread that has ended since)
                os.setpriority(os.PRIO_PROCESS, int(task), value)
    except PermissionError:
        return False
    return True


def engine_main(settings: Settings, socket: str) -> None:
    configure_logging(settings.log_level, "engine")
    if not _set_nice(ENGINE_NICE):
        log.info("the engine process runs at the normal CPU priority (a higher one needs root or CAP_SYS_NICE)")

    async def main() -> None:
        from ..engine.ipc.host import serve_engine
        from ..loop_lag import freeze_startup_objects
        from .app import load_engine

        started = time.monotonic()
        engine = await asyncio.to_thread(load_engine, settings)
        freeze_startup_objects()
        serving = asyncio.create_task(serve_engine(engine, socket, started))
        # SIGTERM (the front, at the end) ends it as a return does, so that the interpreter's exit cleans up:
        # killed outright, it left the multiprocessing lock of tqdm's progress bars (the weights' loading) for
        # the resource tracker to warn about ("leaked semaphore objects") after Ctrl-C.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, serving.cancel)
        await asyncio.wait([serving, asyncio.create_task(_orphaned())], return_when=asyncio.FIRST_COMPLETED)
        serving.cancel()
        engine.close()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front ends it (SIGTERM) once the media processes are done
    asyncio.run(main())


def media_main(settings: Settings, mark: str, socket: str, engine_socket: str, restart: bool) -> None:
    configure_logging(settings.log_level, mark)
    # (a restart lowers its priority only where it can raise it again: else its calls would stay below the others')
    low = _set_nice(MEDIA_NICE) and restart and _set_nice(RESTART_NICE)
    import torch

    # silero-vad's products are tiny: more intra-op threads only spin, taking the cores the engine and the other
    # media processes need (2-core CPU, 2 calls: first packet 1.0-1.4 s with torch's default, against ...)
    torch.set_num_threads(1)

    async def main() -> int:
        from ..engine.ipc.remote import RemoteEngine
        from .app import load_captions, serve

        # the recogniser (Moonshine's load and warm-up: 5.5 s of a CPU core) loads while the engine does
        captions = asyncio.create_task(asyncio.to_thread(load_captions, settings))
        engine = await RemoteEngine(engine_socket, mark).connect(ENGINE_WAIT_S)
        if low:
            _set_nice(MEDIA_NICE)
        serving = asyncio.create_task(serve(settings, engine=engine, unix_path=socket, tag=mark + ".",
                                            captions=captions))
        orphaned = asyncio.create_task(_orphaned())
        await asyncio.wait([serving, orphaned], return_when=asyncio.FIRST_COMPLETED)
        orphaned.cancel()
        code = serving.result() if serving.done() else 1
        serving.cancel()
        await engine.close()
        return code

    raise SystemExit(asyncio.run(main()))


# ---- the front: starts and watches the others ------------------------------------------------------------------
class Supervisor:
    def __init__(self, settings: Settings, count: int) -> None:
        self.settings = settings
        self.runtime = Path(tempfile.mkdtemp(prefix="rtc-agent-"))
        self.engine_socket = str(self.runtime / "engine.sock")
        self._spawn = multiprocessing.get_context("spawn")
        self.engine = self._start(engine_main, "engine", self.engine_socket)
        self.media = [MediaProcess(f"m{i}", self.runtime / f"media-{i}.sock") for i in range(count)]
        self._started_at: dict[str, float] = {}
        self.processes: dict[str, BaseProcess] = {m.mark: self._start_media(m, restart=False) for m in self.media}
        self.stopping = False

    def _start(self, target: Any, name: str, *args: Any) -> BaseProcess:
        process = self._spawn.Process(target=target, args=(self.settings, *args), name=f"rtc-agent-{name}")
        process.start()
        log.info("%s process started (pid %d)", name, process.pid)
        return process

    def _start_media(self, media: MediaProcess, restart: bool) -> BaseProcess:
        process = self._start(media_main, media.mark, media.mark, str(media.socket), self.engine_socket, restart)
        media.pid = process.pid
        self._started_at[media.mark] = time.monotonic()
        return process

    async def watch(self, front: Front) -> str:
        """Restarts media processes that die; returns why the server must stop (the engine failed to load)."""
        while True:
            await asyncio.sleep(WATCH_S)
            if not self.engine.is_alive() and not front.engine.ready and front.engine.lost is None:
                return f"the engine process exited ({self.engine.exitcode}) before it was ready"
            for media in self.media:
                process = self.processes[media.mark]
                if process.is_alive() or self.stopping or front.draining:
                    continue
                if media.pid == process.pid:  # (not yet reported)
                    log.error("media process %s (pid %s) exited (%s): its calls ended; starting another",
                              media.mark, process.pid, process.exitcode)
                    front.forget(media)
                    media.pid = None
                if time.monotonic() - self._started_at[media.mark] >= CRASH_LOOP_S:  # (no crash loop)
                    self.processes[media.mark] = self._start_media(media, restart=True)

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM to every media process (each drains its calls) and wait for them all to end."""
        for process in self.processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s + STOP_S
        while any(p.is_alive() for p in self.processes.values()) and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_S)

    async def stop(self) -> None:
        self.stopping = True
        for process in self.processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)
        await self._join(list(self.processes.values()))
        if self.engine.is_alive():
            self.engine.terminate()
        await self._join([self.engine])
        shutil.rmtree(self.runtime, ignore_errors=True)

    @staticmethod
    async def _join(processes: list[BaseProcess]) -> None:
        deadline = time.monotonic() + STOP_S
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for process in processes:
            if process.is_alive():
                log.warning("%s did not end in %g s: killed", process.name, STOP_S)
                process.kill()
            process.join()


async def serve_split(settings: Settings, count: int) -> int:
    """Runs the front until SIGINT (0), or SIGTERM and the drain of every media process (0), or until the engine
    fails to load (1)."""
    from ..engine.ipc.remote import RemoteEngine
    from ..loop_lag import freeze_startup_objects
    from .app import AccessLogger

    rate_limit_logging()
    supervisor = Supervisor(settings, count)
    engine = RemoteEngine(supervisor.engine_socket, "front")
    front = Front(settings, supervisor.media, engine, supervisor.engine.pid)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[api_guard])
    app[SETTINGS] = settings
    app.router.add_get("/healthz", front.healthz)
    app.router.add_get("/readyz", front.readyz)
    app.router.add_get("/capacity", front.capacity)
    app.router.add_get("/metrics", front.metrics_page)
    app.router.add_route("*", "/{path:.*}", front.proxy)
    runner = Runner(app, request_timeout_s=settings.request_timeout_s, max_connections=settings.max_connections,
                    on_refused=front.connections_refused.inc, access_log_class=AccessLogger,
                    handle_signals=False)
    await runner.setup()
    tasks: list[asyncio.Task[Any]] = []
    try:
        await web.TCPSite(runner, settings.host, settings.port, ssl_context=tls.server_context(settings)).start()
        log.info("listening on %s://%s:%d/ with %d media processes", settings.scheme, settings.host, settings.port,
                 count)
        stop, drain = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, drain.set)
        watching = asyncio.create_task(supervisor.watch(front), name="supervisor")
        tasks = [watching, asyncio.create_task(front.watch(), name="media-status"),
                 asyncio.create_task(engine.connect(ENGINE_WAIT_S), name="engine-connect"),
                 asyncio.create_task(front.loop_lag.watch(), name="loop-lag")]
        # The front imports torch and transformers too (through the engine's client and the server's modules): a
        # full collection over them would hold its loop for 150-300 ms
        freeze_startup_objects()
        front.gc_pauses.install()
        stopping, draining = asyncio.create_task(stop.wait()), asyncio.create_task(drain.wait())
        tasks += [stopping, draining]
        await asyncio.wait([stopping, draining, watching], return_when=asyncio.FIRST_COMPLETED)
        if watching.done():
            log.error("%s", watching.result())
            return 1
        if drain.is_set() and not stop.is_set():
            front.draining = True
            log.info("draining: no new calls; waiting for the media processes' calls to end")
            await asyncio.wait([stopping, asyncio.create_task(supervisor.drain(settings.drain_timeout_s))],
                               return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down")
        return 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.close()
        await supervisor.stop()
        await front.close()
        await runner.cleanup()

