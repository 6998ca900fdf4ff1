"""Real-browser test harness: a loopback-only network namespace, `rtc-agent serve` and Debian's Chromium in it.

The namespace is held open by a small process made with `unshare -n` (as root) or `unshare -rn` (a user
namespace, for everyone else) that brings `lo` up and then waits. The server and Chromium join it with `nsenter`.
Playwright talks to Chromium over a pipe (--remote-debugging-pipe), not the network, so the test process itself
stays outside; what the tests ask the server goes through small helper processes in the namespace (or through
the page's own fetch).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rtc_support import metric  # noqa: F401  (the tests take it from here too)

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("RTC_AGENT_CHROMIUM", "/usr/bin/chromium")
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}

# Brings lo up without iproute2 (SIOCGIFFLAGS / SIOCSIFFLAGS), says so, and holds the namespace until stdin closes.
_HOLDER = r"""
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
req = struct.pack("16sH", b"lo", 0)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
print(" ".join(sorted(name for _, name in socket.if_nameindex())), flush=True)
sys.stdin.read()
"""

_HTTP = r"""
import json, sys, time, urllib.request, urllib.error
method, url, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
headers = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
deadline = time.monotonic() + timeout
while True:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    except OSError as e:
        status, body = 0, str(e)
    if status or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({"status": status, "body": body}))
"""


class LoopbackNamespace:
    """A network namespace whose only interface is `lo`."""

    def __init__(self) -> None:
        self.root = os.geteuid() == 0
        tries = [["unshare", "-n"], ["unshare", "-rn"]] if self.root else [["unshare", "-rn"]]
        errors = []
        for cmd in tries:
            proc = subprocess.Popen([*cmd, sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = proc.stdout.readline().split()
            if line == ["lo"]:
                self.proc = proc
                self.user_ns = cmd[1] == "-rn"
                break
            proc.kill()
            errors.append(f"{' '.join(cmd)}: {proc.stderr.read().strip() or line}")
        else:
            raise RuntimeError("cannot make a loopback-only network namespace: " + "; ".join(errors))
        self.pid = self.proc.pid  # unshare execs the holder: same pid
        self.prefix = ["nsenter", "-t", str(self.pid), "-n"]
        if self.user_ns:
            self.prefix += ["-U", "--preserve-credentials"]

    def command(self, argv: list[str]) -> list[str]:
        return [*self.prefix, *argv]

    def http(self, method: str, url: str, *, wait_s: float = 0.0, headers: dict[str, str] | None = None
             ) -> tuple[int, str]:
        """One request from inside the namespace; with wait_s, retries until the server answers at all."""
        out = subprocess.run(self.command([sys.executable, "-c", _HTTP, method, url, str(wait_s),
                                           json.dumps(headers or {})]),
                             capture_output=True, text=True, timeout=wait_s + 30, check=True)
        result = json.loads(out.stdout)
        return result["status"], result["body"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class HostNetwork:
    """Stand-in when RTC_AGENT_BROWSER_NO_NETNS=1: everything on the host's loopback (for machines that cannot
    make namespaces; CI does not use it)."""

    user_ns = False

    def command(self, argv: list[str]) -> list[str]:
        return list(argv)

    http = LoopbackNamespace.http

    def close(self) -> None:
        pass



class Server:
    """`rtc-agent serve` (built-in tiny model, CPU) inside the namespace, split into processes by role as on a GPU
    (the front, the engine and two media processes): the page, its calls, resume and the Realtime SDK go through
    the front."""

    def __init__(self, net: LoopbackNamespace | HostNetwork, port: int, log_path: Path, *extra: str) -> None:
        self.net, self.port, self.log_path, self.extra = net, port, log_path, extra
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> "Server":
        cli = shutil.which("rtc-agent", path=str(Path(sys.executable).parent)) or "rtc-agent"
        argv = [cli, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--ice-host-address", "127.0.0.1",
                "--media-processes", "2", *self.extra]
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.net.command(argv), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rtc-agent serve exited ({self.proc.returncode}); see {self.log_path}")
            status, _ = self.net.http("GET", self.url + "/readyz", wait_s=min(20.0, deadline - time.monotonic()))
            if status == 200:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"rtc-agent serve was not ready within {timeout_s} s; see {self.log_path}")

    def stop(self) -> None:
        """Ctrl-C (SIGINT to the process group): the server ends at once, its calls with it (SIGTERM would drain
        them first for up to drain_timeout_s; tests/test_drain.py checks that)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def get(self, path: str) -> tuple[int, str]:
        return self.net.http("GET", self.url + path)

    def metrics(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, body
        return body

    def metric(self, name: str) -> float:
        return metric(self.metrics(), name)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def chromium_wrapper(net: LoopbackNamespace | HostNetwork, directory: Path) -> Path:
    """An executable that starts Debian's Chromium inside the namespace (Playwright launches it)."""
    path = directory / "chromium-in-netns"
    prefix = " ".join(net.command([]))
    path.write_text(f"#!/bin/sh\nexec {prefix} {CHROMIUM} \"$@\"\n")
    path.chmod(0o755)
    return path


INSECURE_HOST = "phone.test"  # resolves to 127.0.0.1 but is no secure context (like a phone on a LAN over http)


def chromium_args(speech_wav: Path, *, deny_media: bool = False, fake_devices: bool = True) -> list[str]:
    devices = ["--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={speech_wav}"]
    return [
        "--use-fake-ui-for-media-stream" + ("=deny" if deny_media else ""),
        *(devices if fake_devices else []),
        "--auto-select-desktop-capture-source=Entire screen",
        f"--host-resolver-rules=MAP {INSECURE_HOST} 127.0.0.1",
        "--allow-loopback-in-peer-connection",
        "--autoplay-policy=no-user-gesture-required",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        "--no-first-run",
        "--no-default-browser-check",
        "--mute-audio",
    ]


SPEECH = "Hello there. What is the weather like today? Tell me something nice."
QUESTION = "What time does the library open on Saturday?"  # the captions tests' caller


def make_speech_wav(directory: Path, text: str = SPEECH, name: str = "speech") -> Path:
    """A caller's utterance made by espeak-ng, as Chromium's fake microphone plays it: 48 kHz mono s16, with
    silence after it so the server's turn detector ends the turn (Chromium loops the file)."""
    raw = directory / f"{name}-raw.wav"
    out = directory / f"{name}.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", "48000", "-c", "1", "-b", "16", str(out), "pad", "0.3", "3.2"],
                   check=True)
    return out


def missing_tools() -> list[str]:
    need = {"chromium": CHROMIUM, "espeak-ng": "espeak-ng", "sox": "sox", "unshare": "unshare", "nsenter": "nsenter"}
    return [name for name, exe in need.items() if not shutil.which(exe)]


def new_tmp(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
