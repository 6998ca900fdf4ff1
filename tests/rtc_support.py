"""Shared pieces of the server/media/client tests: espeak-ng speech, one tiny engine per process, a real server
on a loopback port, and a real aiortc caller. Nothing is mocked; all traffic stays on 127.0.0.1."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection

from rtc_agent.client.microphone import RATE, Microphone, load_audio, speech_spans
from rtc_agent.client.peer import Call
from rtc_agent.config import Settings, TurnSettings, build_settings
from rtc_agent.media.ice import use_host_addresses

LOOPBACK = ("127.0.0.1",)
SENTENCE = "What is the weather like in Paris today?"

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


@pytest.fixture(autouse=True)
def restore_ice() -> Any:
    """Servers and callers here use only 127.0.0.1 for ICE (a process-wide aioice setting): undo it after each
    test, so that other test files see the stock behaviour. Import it into a test module to use it."""
    import aioice.ice

    stock = aioice.ice.get_host_addresses
    yield
    aioice.ice.get_host_addresses = stock


@functools.lru_cache(maxsize=None)
def speech(text: str = SENTENCE, rate: int = RATE) -> np.ndarray:
    """espeak-ng speaking `text`, as mono float32 at `rate`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        return load_audio(str(path), rate)


def speech_end(samples: np.ndarray) -> int:
    return speech_spans(samples)[-1][1]


@functools.lru_cache(maxsize=None)
def engine(max_answer_tokens: int = 32) -> Any:
    """The built-in tiny model, loaded once per test process and shared (as sessions share it in the server).
    Answers are kept short so that a test turn takes about a second; a function call needs more tokens
    (CALL_TOKENS: the babbling model fills a string up to its 256-character bound)."""
    from rtc_agent.engine import Engine, EngineOptions

    return Engine.load(EngineOptions(model="tiny", device="cpu", max_answer_tokens=max_answer_tokens))


CALL_TOKENS = 256  # engine(CALL_TOKENS): answers long enough for any call (the engine's default limit)
# Two functions for the tests of calls, as the Realtime API's session.tools lists them: an enum and a bounded
# integer; an array of bounded strings and a boolean
TOOLS = [
    {"type": "function", "name": "set_heating", "description": "Set the seat heating of one row of the car.",
     "parameters": {"type": "object", "properties": {
         "zone": {"type": "string", "enum": ["front", "back"]},
         "level": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["zone", "level"]}},
    {"type": "function", "name": "add_to_list", "description": "Add items to the shopping list.",
     "parameters": {"type": "object", "properties": {
         "items": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 20}, "minItems": 1,
                   "maxItems": 3},
         "urgent": {"type": "boolean"}}, "required": ["items"]}},
]


def valid_call(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments, parsed, once checked against its tool's schema in TOOLS by jsonschema (a validator
    that is not ours)."""
    import jsonschema

    parsed = json.loads(arguments)
    jsonschema.validate(parsed, next(t["parameters"] for t in TOOLS if t["name"] == name))
    return parsed


class RecordingSession:
    """A real engine session that also keeps a record of the media the conversation gave it, in order: the
    tests' window on what was pushed and with which media-clock times. Everything still runs in the engine."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.pushed: list[tuple[str, float | None, tuple[int, ...]]] = []  # (kind, at, shape)
        self.urgent_audio: list[float | None] = []  # the `at` of the audio pushes made urgent
        self.calls: list[str] = []  # "push", "prepare", "respond" as called; "pushed", "prepared" as they return

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    @property
    def images(self) -> list[tuple[float | None, tuple[int, ...]]]:
        return [(at, shape) for kind, at, shape in self.pushed if kind == "image"]

    async def push_audio(self, samples: np.ndarray, sample_rate: int = 16000, at: float | None = None,
                         urgent: bool = False) -> None:
        self.pushed.append(("audio", at, samples.shape))
        if urgent:
            self.urgent_audio.append(at)
        self.calls.append("push")
        await self.session.push_audio(samples, sample_rate, at=at, urgent=urgent)
        self.calls.append("pushed")

    async def push_image(self, image: np.ndarray, at: float) -> None:
        self.pushed.append(("image", at, image.shape))
        await self.session.push_image(image, at)

    async def prepare_answer(self) -> None:
        self.calls.append("prepare")
        await self.session.prepare_answer()
        self.calls.append("prepared")

    def respond(self) -> Any:
        self.calls.append("respond")
        return self.session.respond()


class RecordingEngine:
    """The shared tiny engine, handing out RecordingSessions (for `server(engine_=RecordingEngine())`)."""

    def __init__(self) -> None:
        self.engine = engine()
        self.sessions: list[RecordingSession] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def new_session(self, options: Any) -> RecordingSession:
        session = RecordingSession(self.engine.new_session(options))
        self.sessions.append(session)
        return session


class SeededEngine:
    """The shared tiny engine, its sessions' sampling seeded (for `server(engine_=SeededEngine())`): for tests
    that need an answer still speaking a while after it starts, which the random tiny Talker, unseeded, ends at
    its first frames now and then (codec EOS)."""

    def __init__(self, seed: int = 0) -> None:
        self.engine, self.seed = engine(), seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def new_session(self, options: Any) -> Any:
        return self.engine.new_session(dataclasses.replace(options, seed=self.seed))


def settings(**overrides: Any) -> Settings:
    """Test server settings; turns are server_vad's fixed silence unless a test asks for semantic_vad."""
    turn = {"turn_detection": "server_vad"}
    turn_fields = {f.name for f in dataclasses.fields(TurnSettings)}
    turn.update({k: overrides.pop(k) for k in list(overrides) if k in turn_fields})
    base = build_settings({"ice_host_addresses": LOOPBACK, "max_answer_s": 1.0, "port": 0}, env={})
    return dataclasses.replace(base, turn=dataclasses.replace(base.turn, **turn), **overrides)


@contextlib.asynccontextmanager
async def server(engine_: Any = "shared", ssl_context: Any = None, memory: Any = None, **overrides: Any
                 ) -> AsyncIterator[tuple[str, web.Application]]:
    """A real server on a free loopback port; yields its URL and app. engine_: "shared" (the tiny engine of this
    process), None (the server loads its own in the background), or an engine. `memory`: the memory guard's
    reader (default: the engine's, which reads nothing on a CPU)."""
    async with contextlib.AsyncExitStack() as stack:
        chosen = engine() if engine_ == "shared" else engine_
        served = None if chosen is None else await stack.enter_async_context(hosted(chosen))
        yield await stack.enter_async_context(listening(create_app_for(served, memory, overrides), ssl_context))


def create_app_for(engine_: Any, memory: Any, overrides: dict[str, Any]) -> web.Application:
    from rtc_agent.server.app import create_app

    return create_app(settings(**overrides), engine=engine_, memory=memory)


@contextlib.asynccontextmanager
async def listening(app: web.Application, ssl_context: Any = None) -> AsyncIterator[tuple[str, web.Application]]:
    from rtc_agent.server.app import make_runner

    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    scheme = "https" if ssl_context else "http"
    try:
        yield f"{scheme}://127.0.0.1:{runner.addresses[0][1]}", app
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def hosted(engine_: Any) -> AsyncIterator[Any]:
    """`engine_` served as the engine process serves its engine (engine/ipc/host.py), here on this test's event loop,
    and the server's view of it: a RemoteEngine over the Unix socket. Every server test crosses the process
    split's boundary (records, pickling, the socket, request order), with the engine in this process so that it
    is loaded once."""
    from rtc_agent.engine.ipc.host import EngineHost
    from rtc_agent.engine.ipc.remote import RemoteEngine

    with tempfile.TemporaryDirectory(prefix="rtc-agent-test-") as where:
        path = Path(where) / "engine.sock"
        host = EngineHost(engine_)
        await host.start(path)
        remote = RemoteEngine(path, "test")
        try:
            yield await remote.connect()
        finally:
            await remote.close()
            await host.close()


async def audio_offer() -> str:
    """The SDP offer of a real aiortc caller: a microphone line (sendrecv, Opus) and the `events` data channel."""
    pc = RTCPeerConnection()
    pc.addTransceiver("audio")
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


async def wait_ready(url: str, timeout_s: float = 60.0, verify_tls: bool = True) -> None:
    """Until the server says it is ready: the engine there, and each media process warmed up (`warm_up_media`)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(int(timeout_s * 10)):
            async with http.get(f"{url}/readyz", ssl=verify_tls) as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError("the server did not get ready")


@contextlib.asynccontextmanager
async def caller(url: str, **kwargs: Any) -> AsyncIterator[tuple[Call, Microphone]]:
    """A connected aiortc caller with a scriptable microphone; hangs up at the end."""
    use_host_addresses(LOOPBACK)
    await wait_ready(url)
    mic, call = Microphone(), Call(url, **kwargs)
    try:
        await call.connect(mic)
    except BaseException:
        await call.close()
        raise
    try:
        yield call, mic
    finally:
        await call.hang_up()


async def say(call: Call, mic: Microphone, text: str = SENTENCE) -> float:
    """Speaks `text` into the call; returns when its speech ends (time.monotonic()), once it has been sent."""
    samples = speech(text)
    start = mic.play(samples)
    end_at = mic.time_at(start + speech_end(samples))
    await asyncio.sleep(max(0.0, end_at - asyncio.get_running_loop().time()))
    return end_at


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as r:
            return await r.text()


def metric(text: str, name: str) -> float:
    """The value of one series (`name` with its labels, if any: `rtc_agent_turns_total{status="completed"}`), 0
    when absent. A server split into processes labels each series with its `process` as well: the sum over them."""
    from prometheus_client.parser import text_string_to_metric_families

    base, _, labels = name.partition("{")
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == base and {k: v for k, v in sample.labels.items() if k != "process"} == wanted)


def run(coro: Any, timeout_s: float = 120.0) -> Any:
    """Runs one test coroutine with a hard time limit, on a loop of its own in a fresh thread: the main thread
    may already run a loop (Playwright's sync API keeps one running while its browser is up)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-loop") as pool:
        return pool.submit(asyncio.run, asyncio.wait_for(coro, timeout_s)).result()
