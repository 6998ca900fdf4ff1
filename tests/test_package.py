"""The built wheel, installed into a new virtual environment as a user or the container image installs it, run from
a directory outside the repository: the page loads, a call is answered, and the defaults are in force (the page,
the model configs and, through the pipecat-ai dependency, the end-of-turn model all come with the install).

The venv holds only what pip resolves for the wheel: torch first, from this machine's CPU build (the image gets
the CUDA build from PyPI), then deploy/Dockerfile's own `pip install` of the wheel, its dependencies from the
index. Nothing is linked in from the development environment. The venv is built once, from the start of the run
(`Build`); the last test removes pipecat-ai from it to check the fallback.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from netns_support import needs_namespaces, private_network, start, stop
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import caller, needs_espeak, run, say
from test_deploy import image_pip_install

from rtc_agent.smart_turn import INSTALL_HINT
from rtc_agent.media.moonshine import INSTALL_HINT as RECOGNISER_HINT

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("rtc_agent", "web", "models")  # the folders the wheel is built from (web/ and models/ go inside rtc_agent/)
PORT = 8080
URL = f"http://127.0.0.1:{PORT}"
CLEAN = {"PYTHONPATH": ""}  # the server must import rtc_agent from the venv only (Python ignores an empty one)
pytestmark = [pytest.mark.timeout(600)]  # the first test may wait for the build: pip downloads ~60 packages


class Build:
    """The wheel, built from a copy of the sources (setuptools writes build/ and *.egg-info next to them), and a new
    venv with torch (this environment's release) and the wheel installed by the Dockerfile's command. The suite
    starts it at its start (tests/conftest.py), on a thread of its own, its pip runs at idle CPU priority: it takes
    about 75 s of the 2 cores, which the calls before this file leave idle."""

    def __init__(self) -> None:
        self.where = Path(tempfile.mkdtemp(prefix="rtc-agent-package-"))
        atexit.register(shutil.rmtree, self.where, ignore_errors=True)  # (also where the run ends before its tests)
        self.result: concurrent.futures.Future[tuple[Path, Path]] = concurrent.futures.Future()
        threading.Thread(target=self._run, name="package-build", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result.set_result((wheel := self._wheel(), self._venv(wheel)))
        except BaseException as exc:
            self.result.set_exception(exc)

    def _wheel(self) -> Path:
        src, out = self.where / "src", self.where / "dist"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
        for folder in SHIPPED:
            shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
        _idle([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
               str(src)], timeout=240)
        (built,) = out.glob("rtc_agent-*.whl")
        return built

    def _venv(self, wheel: Path) -> Path:
        where = self.where / "venv"
        _idle([sys.executable, "-m", "venv", str(where)], timeout=120)
        torch = "torch==" + importlib.metadata.version("torch").split("+")[0]
        # (torch without its 17 s of byte-compiling on 2 cores: the server compiles what it imports)
        for command in ([str(where / "bin" / "pip"), "install", "--no-compile", torch],
                        image_pip_install(where, wheel)):
            _idle([*command, "-q", "--disable-pip-version-check"], timeout=480, env={**os.environ, **CLEAN})
        return where


def _idle(command: list[str], timeout: float, env: dict[str, str] | None = None) -> None:
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                         preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)))
    assert out.returncode == 0, out.stderr[-3000:]


_started: Build | None = None


def start_build() -> Build:
    """The package's build, started once per process."""
    global _started
    if _started is None:
        _started = Build()
    return _started


@pytest.fixture(scope="module")
def built() -> tuple[Path, Path]:
    return start_build().result.result(timeout=900)


@pytest.fixture(scope="module")
def wheel(built: tuple[Path, Path]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def venv(built: tuple[Path, Path]) -> Path:
    return built[1]


def rtc_agent(venv: Path, *args: str) -> list[str]:
    return [str(venv / "bin" / "rtc-agent"), "serve", "--port", str(PORT), "--device", "cpu",
            "--ice-host-address", "127.0.0.1", *args]


async def until_up(http: aiohttp.ClientSession, proc: subprocess.Popen[bytes], path: str = "/readyz") -> Any:
    """GET `path` until it answers 200 (the server may still be loading); its JSON or text."""
    deadline = time.monotonic() + 90
    while True:
        try:
            async with http.get(URL + path) as r:
                if r.status == 200:
                    return await (r.json() if r.content_type == "application/json" else r.text())
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, f"{path}: the server did not come up"
        await asyncio.sleep(0.2)


def test_the_wheel_carries_every_module_the_page_and_the_model_configs(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "rtc_agent").rglob("*.py")}
    page = {f"rtc_agent/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "web").iterdir()}
    configs = {f"rtc_agent/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "models").glob("*.json")}
    assert "rtc_agent/web/index.html" in page and "rtc_agent/models/tiny.json" in configs
    assert modules | page | configs <= names, sorted((modules | page | configs) - names)
    assert not [n for n in names if n.startswith(("studies/", "scripts/", "tests/"))]


@needs_espeak
@needs_namespaces
def test_an_installed_wheel_serves_the_defaults_and_answers_a_call_from_tmp(venv: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import rtc_agent; print(rtc_agent.__file__)"],
                           cwd=elsewhere, check=True, capture_output=True, text=True, env={**os.environ, **CLEAN}
                           ).stdout
    assert where.startswith(str(venv)), where

    async def main() -> None:
        private_network()
        proc = start(rtc_agent(venv, "--max-answer-s", "1"), tmp_path / "serve.log", env=CLEAN, cwd=elsewhere)
        try:
            async with aiohttp.ClientSession() as http:
                page = await until_up(http, proc, "/")
                assert "<html" in page.lower()
                async with http.get(f"{URL}/app.js") as r:
                    assert r.status == 200
                async with http.get(f"{URL}/api/config") as r:
                    config = await r.json()
                assert config["turn_detection"]["type"] == "semantic_vad" and config["turn_detection_note"] is None
                assert config["input_audio_transcription"]["model"] == "moonshine-base-en"
            async with caller(URL) as (call, mic):
                created = (await call.next_event("session.created", timeout_s=10))["session"]
                assert created["turn_detection"]["type"] == "semantic_vad" and created["turn_detection_note"] is None
                await say(call, mic)
                done = (await call.next_event("response.done", timeout_s=60))["response"]
                assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
                for _ in range(300):  # (the caption may have come before response.done, or come after it)
                    captions = call.events_of("conversation.item.input_audio_transcription.completed")
                    if captions:
                        break
                    await asyncio.sleep(0.1)
                text = " ".join(c["transcript"] for c in captions).lower()  # the recogniser came with the install
                assert "paris" in text or "weather" in text, captions
                assert done["metrics"]["end_of_turn"]["type"] == "semantic_vad"
        finally:
            stop(proc, signal.SIGINT)
        assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-2000:]

    run(main(), timeout_s=200)


@needs_namespaces
def test_without_the_models_the_defaults_run_server_vad_without_captions_and_either_by_name_refuses(
        venv: Path, tmp_path: Path) -> None:
    out = subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "pipecat-ai", "moonshine-cpp"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    async def main() -> None:
        private_network()
        log = tmp_path / "serve.log"
        proc = start(rtc_agent(venv), log, env=CLEAN, cwd=tmp_path)
        try:
            async with aiohttp.ClientSession() as http:
                await until_up(http, proc)  # started, the tiny model loaded
                async with http.get(f"{URL}/api/config") as r:
                    config = await r.json()
            async with caller(URL) as (call, _):
                created = (await call.next_event("session.created", timeout_s=10))["session"]
        finally:
            stop(proc, signal.SIGINT)
        assert proc.returncode == 0, log.read_text()[-2000:]
        assert config["turn_detection"]["type"] == "server_vad"
        note = config["turn_detection_note"]
        assert "semantic_vad" in note and INSTALL_HINT in note
        assert (created["turn_detection"]["type"], created["turn_detection_note"]) == ("server_vad", note)
        assert log.read_text().count(note) == 1  # said once in the log
        captions_note = config["input_audio_transcription_note"]
        assert config["input_audio_transcription"] is None and RECOGNISER_HINT in captions_note
        assert (created["input_audio_transcription"], created["input_audio_transcription_note"]) == (None,
                                                                                                    captions_note)
        assert log.read_text().count(captions_note) == 1

        # asked for by name, on the command line or in the environment
        by_name = ((["--turn-detection", "semantic_vad"], {}, INSTALL_HINT),
                   ([], {"RTC_AGENT_TURN_DETECTION": "semantic_vad"}, INSTALL_HINT),
                   (["--turn-detection", "server_vad", "--transcription", "on"], {}, RECOGNISER_HINT))
        for args, env, hint in by_name:
            refused = start(rtc_agent(venv, *args), tmp_path / "refused.log", env={**CLEAN, **env}, cwd=tmp_path)
            returncode = await asyncio.to_thread(refused.wait, 90)
            assert returncode != 0 and hint in (tmp_path / "refused.log").read_text()

    run(main(), timeout_s=200)
