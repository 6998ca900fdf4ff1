"""The built wheel, installed into a fresh virtual environment, run from a directory outside the repository: the
page loads and a call is answered (the page and the model configs ship inside the package).

The fresh venv sees the already installed dependencies (torch and the rest) through a .pth file that points at a
folder of links to them, with the repository's own editable rtc_agent left out, so `pip install <wheel>` finds
every dependency satisfied and downloads nothing, and `import rtc_agent` can only come from the wheel.
"""
from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import aiohttp
import pytest

from netns_support import needs_namespaces, private_network, start, stop
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import caller, needs_espeak, run, say

ROOT = Path(__file__).resolve().parents[1]
PORT = 8080
pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources (setuptools writes build/ and *.egg-info next to them)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "rtc_agent", src / "rtc_agent", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=240)
    (built,) = out.glob("rtc_agent-*.whl")
    return built


def fresh_venv(where: Path) -> Path:
    """A new venv whose only view of this environment is its dependencies (not rtc_agent)."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    # the venv's own (older) setuptools would shadow the one torch's metadata asks for
    subprocess.run([str(where / "bin" / "pip"), "uninstall", "-q", "-y", "setuptools"], capture_output=True,
                   timeout=120)
    deps = where / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("rtc_agent", "__editable__", "_virtualenv", "distutils-precedence")):
            (deps / entry.name).symlink_to(entry)
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(where / "bin" / "python"), "-c", ask], check=True, capture_output=True,
                             text=True).stdout.strip()
    Path(purelib, "installed-dependencies.pth").write_text(f"{deps}\n")
    return where


def test_the_wheel_carries_the_page_and_the_model_configs(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("rtc_agent/web/index.html", "rtc_agent/web/app.js", "rtc_agent/models/tiny.json",
                   "rtc_agent/models/qwen3-omni-30b-a3b-instruct.json"):
        assert needed in names


@needs_espeak
@needs_namespaces
def test_an_installed_wheel_serves_the_page_and_answers_a_call_from_tmp(wheel: Path, tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv")
    out = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--no-index",
                          str(wheel)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import rtc_agent; print(rtc_agent.__file__)"],
                           cwd=elsewhere, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(venv)), where

    async def main() -> None:
        private_network()
        proc = start([str(venv / "bin" / "rtc-agent"), "serve", "--port", str(PORT), "--max-answer-s", "1",
                      "--device", "cpu", "--ice-host-address", "127.0.0.1"], tmp_path / "serve.log", cwd=elsewhere)
        url = f"http://127.0.0.1:{PORT}"
        try:
            async with aiohttp.ClientSession() as http:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        async with http.get(f"{url}/") as r:
                            page = await r.text()
                            break
                    except aiohttp.ClientError:
                        assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
                        await asyncio.sleep(0.2)
                assert r.status == 200 and "<html" in page.lower()
                async with http.get(f"{url}/app.js") as r:
                    assert r.status == 200
            async with caller(url) as (call, mic):
                await say(call, mic)
                done = (await call.next_event("response.done", timeout_s=60))["response"]
                assert done["status"] == "completed" and done["metrics"]["frames_sent"] > 0
        finally:
            stop(proc, signal.SIGINT)
        assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-2000:]

    run(main(), timeout_s=200)
