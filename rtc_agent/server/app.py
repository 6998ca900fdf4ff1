"""The aiohttp application: routes, engine loading in the background, and `serve` (listen until a signal;
SIGTERM drains: no new calls, the process ends when the last call has)."""
from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiortc import RTCCertificate

from ..config import VOICES, Settings
from ..loop_lag import freeze_startup_objects
from ..media import last_words, moonshine
from ..media.captions import CaptionPool
from ..media.end_of_turn import LOCAL_AT_ONCE, EndOfTurnScorer, installed_scorer, shared_scorer
from ..smart_turn import model_path
from ..media.ice import browser_ice_servers, use_host_addresses
from ..media.outbound import silence_packets
from . import tls
from .errors import ApiError
from .guard import SETTINGS, api_guard
from .limits import Runner, rate_limit_logging
from .memory_guard import MemoryGuard
from .metrics import Metrics
from .protocol import transcription_description, turn_description
from .realtime_http import add_realtime_routes, realtime_middleware
from .sessions import Sessions
from .signaling import default_transcription, hang_up, offer, session_status
from .state import STATE, ServerState
from .turn import turn_ice_servers

log = logging.getLogger("rtc_agent.server")
LOADER = web.AppKey("rtc_agent_loader", asyncio.Task)
GUARD = web.AppKey("rtc_agent_memory_guard", asyncio.Task)
LOOP_LAG = web.AppKey("rtc_agent_loop_lag", asyncio.Task)
QUIET_PATHS = ("/metrics", "/healthz", "/readyz", "/capacity")
DRAIN_POLL_S = 0.5


def create_app(settings: Settings, engine: Any = None, memory: Callable[[], Any] | None = None,
               tag: str = "") -> web.Application:
    """The server; it loads the engine in the background unless one is given (tests share a loaded one; a media
    process gives its RemoteEngine). `memory`: reads the GPU's memory for the memory guard (default: the engine's
    `memory()`; a test may give a reader that reports a chosen fill level). `tag`: a media process's mark on its
    call ids and tokens (ServerState.tag)."""
    use_host_addresses(settings.ice_host_addresses)
    metrics = Metrics()
    state = ServerState(settings, metrics, Sessions(settings.max_sessions, metrics), engine, tag=tag)
    read = memory or (lambda: state.engine.memory() if state.engine is not None else None)
    state.guard = MemoryGuard(read, settings.memory_guard_pct, settings.video_window_s, metrics)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[api_guard, realtime_middleware])
    app[STATE] = state
    app[SETTINGS] = settings
    app.router.add_post("/api/offer", offer)
    app.router.add_get("/api/sessions/{session_id}", session_status)
    app.router.add_delete("/api/sessions/{session_id}", hang_up)
    app.router.add_get("/api/config", client_config)
    app.router.add_route("*", "/api/{rest:.*}", api_not_found)
    add_realtime_routes(app)  # /v1/realtime: the OpenAI Realtime API's calls, WebSocket and client secrets
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/capacity", capacity)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/", index)
    web_dir = Path(settings.web_dir)
    if web_dir.is_dir():
        app.router.add_static("/", web_dir, follow_symlinks=False)
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_end_calls)
    app.on_cleanup.append(_stop_engine)
    return app


# ---- engine lifetime ------------------------------------------------------------------------------------------
async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    app[LOADER] = asyncio.create_task(_load_engine(state), name="engine-loader")
    app[GUARD] = asyncio.create_task(state.guard.run(state.sessions.calls), name="memory-guard")
    app[LOOP_LAG] = asyncio.create_task(state.metrics.loop_lag.watch(), name="loop-lag")
    state.metrics.gc_pauses.install()


async def _load_engine(state: ServerState) -> None:
    s = state.settings
    try:
        if s.turn_detection_note:
            log.warning("%s", s.turn_detection_note)
        if s.turn.turn_detection == "semantic_vad":
            model_path()  # (required: EndOfTurnUnavailable says how to install it, before a model loads for minutes)
        loading = state.engine is None
        # (beside the engine: Moonshine's load and warm-up take 5.5 s of a CPU core)
        captions = state.captions_loading or asyncio.create_task(asyncio.to_thread(load_captions, s))
        if loading:
            state.engine = await asyncio.to_thread(load_engine, s)
        state.captions = await captions
        slots = state.engine.describe()["max_sessions"]
        state.sessions.max_sessions = min(s.max_sessions, slots) if s.max_sessions else slots
        await asyncio.to_thread(state.vads.preload, state.sessions.max_sessions)
        if not state.engine.ready:
            log.info("warming up...")
            await state.engine.warmup()
        # The calls' end-of-turn scorer, loaded here so that no call waits for it
        state.end_of_turn = await asyncio.to_thread(end_of_turn_scorer, s, state.engine)
        await asyncio.to_thread(warm_up_media, state.end_of_turn)
        if loading or state.tag:  # (a media process: torch, silero and the end-of-turn model)
            freeze_startup_objects()
        state.loaded = True
        state.metrics.ready.set(1)
        log.info("ready: %s", state.engine.describe())
        if not state.engine.describe().get("speech", True):
            log.info("text mode: no Talker, answers are text (response.output_text.delta on the data channel)")
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("the model could not be loaded")
        raise


def warm_up_media(end_of_turn: EndOfTurnScorer | None) -> None:
    """What a process's first call would otherwise pay for once (blocking; at start-up). Its connect runs on the
    event loop every call of the process shares, where the first DTLS certificate, the module pyOpenSSL imports
    for the first handshake and the first Opus encode stalled the loop 16-27 ms in each media process on the H200
    host (`RTC_AGENT_STALL_MS`); and its first verdict is the end-of-turn model's first run, 205 ms on one thread
    against 130-138 for the next ones on the 2-core CI machine."""
    RTCCertificate.generateCertificate()
    importlib.import_module("cryptography.hazmat.primitives.serialization")
    silence_packets()
    if end_of_turn is not None:
        end_of_turn.warm_up()


def load_captions(s: Settings) -> CaptionPool | None:
    """The callers' speech recogniser, warmed up (blocking); None where transcription is off or it is not
    installed (then the log says so, once)."""
    if s.transcription_note:
        log.warning("%s", s.transcription_note)
    if s.transcription == "off" or not moonshine.installed():
        return None
    pool = CaptionPool(moonshine.shared())
    pool.warm_up()
    return pool


def end_of_turn_scorer(s: Settings, engine: Any) -> EndOfTurnScorer | None:
    """The end-of-turn scorer of this process's calls: the engine's verdicts where it scores every turn (on its
    GPU), else this process's model, with the engine's verdicts beyond one decision at a time where it takes the
    overflow; None where the model is not installed and semantic_vad was not asked for (then only server_vad is
    offered). (Blocking: it may load models.)"""
    where = engine.describe().get("end_of_turn")
    if where == "engine":
        return EndOfTurnScorer(None, last_words.shared_last_words() if s.last_words else None, engine.score_turn, 0)
    scorer = (shared_scorer if s.turn.turn_detection == "semantic_vad" else installed_scorer)(s.last_words)
    if scorer is not None and where == "overflow":
        return scorer.with_engine(engine.score_turn, LOCAL_AT_ONCE)
    return scorer


def load_engine(s: Settings) -> Any:
    """The engine these settings ask for, loaded (blocking: seconds for `tiny`, minutes for a real checkpoint)."""
    from ..engine import Engine, EngineOptions

    log.info("loading model %s (device %s)...", s.model, s.device)
    return Engine.load(EngineOptions(model=s.model, device=s.device, quantize=s.quantize,
                                     video_window_s=s.video_window_s, max_sessions=s.max_sessions,
                                     text_only=s.no_talker, streaming=not s.no_audio_stream,
                                     gpu_memory_fraction=s.gpu_memory_fraction, end_of_turn=s.end_of_turn_on))


async def _end_calls(app: web.Application) -> None:
    await app[STATE].sessions.close_all("server shutting down")


async def _stop_engine(app: web.Application) -> None:
    app[STATE].metrics.gc_pauses.uninstall()
    if app[STATE].captions is not None:
        app[STATE].captions.close()
    tasks = (app[LOADER], app[GUARD], app[LOOP_LAG])
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- small handlers -----------------------------------------------------------------------------------------
async def api_not_found(request: web.Request) -> web.Response:
    raise ApiError(404, "not_found", f"no API at {request.method} {request.path}")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ready", "engine": state.engine.describe(),
                                  "sessions": len(state.sessions), "max_sessions": state.sessions.max_sessions})
    error = state.load_error or state.engine_lost
    if error:
        return web.json_response({"status": "failed", "error": error}, status=503)
    return web.json_response({"status": "loading"}, status=503)


async def capacity(request: web.Request) -> web.Response:
    """Can this replica take another call? 200: yes. 404: loaded, but every slot is taken or it is draining;
    HAProxy's `http-check disable-on-404` then sends it no new offers but still the requests of calls it holds,
    and a Kubernetes readiness probe counts it as not ready. 503: the model is not loaded (yet)."""
    state = request.app[STATE]
    counts = {"active": len(state.sessions), "free": max(0, state.sessions.free),
              "max_sessions": state.sessions.max_sessions}
    state.guard.check()
    if state.can_take_call:
        return web.json_response({"status": "available", **counts})
    if state.ready and state.draining:
        return web.json_response({"status": "draining", **counts}, status=404)
    if state.ready:
        reason = "memory" if state.memory_full else "slots"
        return web.json_response({"status": "full", "reason": reason, **counts}, status=404)
    return web.json_response({"status": "failed" if state.load_error else "loading", **counts}, status=503)


async def metrics_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.guard.check()  # the memory gauges as of this scrape
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def client_config(request: web.Request) -> web.Response:
    """What a page needs before its offer: ICE servers (TURN with credentials of its own), voices, defaults."""
    state = request.app[STATE]
    s = state.settings
    text_only = not state.engine.describe()["speech"] if state.engine is not None else s.no_talker
    return web.json_response({
        "ice_servers": browser_ice_servers(s.ice_servers) + turn_ice_servers(s),
        "voices": list(VOICES),
        "voice": s.voice,
        "instructions": s.instructions,
        "turn_detection": turn_description(s.turn),
        "turn_detection_note": s.turn_detection_note,  # null, or why semantic_vad is not the default here
        "model": s.model,
        "token_required": bool(s.token),
        "video": {"fps": s.video_fps, "max_side": s.video_max_side},
        "output_modalities": ["text"] if text_only else ["audio"],  # the page shows text mode
        # the page's calls' default (null: off), and why it is off where the recogniser is missing
        "input_audio_transcription": transcription_description(default_transcription(s)),
        "input_audio_transcription_note": s.transcription_note,
    })


async def index(request: web.Request) -> web.StreamResponse:
    page = Path(request.app[STATE].settings.web_dir) / "index.html"
    if page.is_file():
        return web.FileResponse(page, headers={"Cache-Control": "no-cache"})
    return web.Response(text="rtc-agent is running, but its call page (web/index.html) is missing.\n",
                        status=404)


class AccessLogger(AbstractAccessLogger):
    """One line per request, without query strings (a ?token= must not reach the logs); probes at DEBUG."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
        self.logger.log(level, "%s %s %s %d %.1f ms", request.remote, request.method, request.path,
                        response.status, time * 1000)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


# ---- serve --------------------------------------------------------------------------------------------------
def make_runner(app: web.Application, **kwargs: Any) -> Runner:
    """The app's runner with the server's HTTP limits (limits.py)."""
    state = app[STATE]
    s = state.settings
    return Runner(app, request_timeout_s=s.request_timeout_s, max_connections=s.max_connections,
                  on_refused=state.metrics.connections_refused.inc, **kwargs)


# The engine's worker thread needs the GIL for every kernel launch and host copy; at Python's default 5 ms switch
# interval it waits behind the event loop (aiortc, Opus and the VAD of every call). H200, 8 callers at once: server
# ttfp P50 925 ms at 5 ms, 542 ms at 0.5 ms (one process for everything, before the split by role).
SWITCH_INTERVAL_S = 0.0005


async def serve(settings: Settings, engine: Any = None, unix_path: str | None = None, tag: str = "",
                captions: asyncio.Task | None = None) -> int:
    """Runs the server until SIGINT, or SIGTERM and the drain that follows it (0), or until the model fails to
    load (1). A media process (processes.py) gives the engine process's RemoteEngine, the Unix socket the front
    reaches it on, its mark (`tag`) and its recogniser's loading (`load_captions` in a thread, started before the
    engine was up)."""
    rate_limit_logging()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(settings, engine=engine, tag=tag)
    app[STATE].captions_loading = captions
    runner = make_runner(app, access_log_class=AccessLogger, handle_signals=False)
    await runner.setup()
    try:
        if unix_path is not None:
            await web.UnixSite(runner, unix_path).start()
        else:
            ssl_context = tls.server_context(settings)
            await web.TCPSite(runner, settings.host, settings.port, ssl_context=ssl_context).start()
            host = "localhost" if settings.host in ("127.0.0.1", "::1") else settings.host
            log.info("listening on %s://%s:%d/ (token %s, %s)", settings.scheme, host, settings.port,
                     "required" if settings.token else "not required",
                     f"up to {settings.max_sessions} calls" if settings.max_sessions else "as many calls as fit")
        stop, drain = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, drain.set)
        stopping, draining = asyncio.create_task(stop.wait()), asyncio.create_task(drain.wait())
        await asyncio.wait([stopping, draining, app[LOADER]], return_when=asyncio.FIRST_COMPLETED)
        failed = app[LOADER].done() and not app[LOADER].cancelled() and app[LOADER].exception() is not None
        if not failed:
            await asyncio.wait([stopping, draining], return_when=asyncio.FIRST_COMPLETED)
            if drain.is_set() and not stop.is_set():
                await _drain(app[STATE], stop)
        stopping.cancel(), draining.cancel()
        log.info("shutting down")
        return 1 if failed else 0
    finally:
        await runner.cleanup()


async def _drain(state: ServerState, stop: asyncio.Event) -> None:
    """No new calls; wait for the calls in progress to end (at most drain_timeout_s, or until SIGINT)."""
    state.draining = True
    log.info("draining: no new calls; waiting for %d call(s) to end (at most %g s)", len(state.sessions),
             state.settings.drain_timeout_s)
    deadline = time.monotonic() + state.settings.drain_timeout_s
    while len(state.sessions) and time.monotonic() < deadline and not stop.is_set():
        await asyncio.sleep(DRAIN_POLL_S)
