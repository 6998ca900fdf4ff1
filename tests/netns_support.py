"""A private network namespace for the calling thread, and faults on its loopback.

Linux keeps the network namespace per thread: `private_network()` moves the current thread (the test's event-loop
thread, see rtc_support.run) into a new namespace whose only interface is `lo`. Sockets it opens and processes it
starts (coturn, HAProxy, `rtc-agent serve`) live there, so nothing collides with other tests or reaches outside,
and faults on that `lo` touch only this test's traffic. Needs root (CAP_SYS_ADMIN); tests skip otherwise.

Faults here are nftables rules (a drop of all UDP: a blackout). Loss, jitter and reordering come from
udp_impairer on the caller's path: this kernel has no `tc netem` (see there).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
from pathlib import Path
from typing import Callable

import pytest

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
TABLE = "rtc_agent_faults"


def can_make_namespaces() -> bool:
    return os.geteuid() == 0


def private_network() -> None:
    """Moves the calling thread into a new network namespace and brings its `lo` up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed (needs root)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def _run(*cmd: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=10)


class Faults:
    """A blackout on the namespace's `lo`: every UDP datagram (all media, both directions) dropped until clear();
    signaling over TCP goes on. Call from the namespaced thread, or give `command`, which turns an argv into one
    that runs in the namespace (the browser tests' `net.command`)."""

    def __init__(self, command: Callable[[list[str]], list[str]] = list) -> None:
        if shutil.which("nft") is None:
            pytest.skip("blackouts need nft (apt package nftables)")
        self._command = command

    def blackout(self) -> None:
        self.clear()
        script = (f"table inet {TABLE} {{\n chain out {{\n type filter hook output priority 0; policy accept;\n"
                  f" meta l4proto udp drop\n }}\n}}\n")
        out = _run(*self._command(["nft", "-f", "-"]), stdin=script)
        assert out.returncode == 0, out.stderr

    def clear(self) -> None:
        _run(*self._command(["nft", "delete", "table", "inet", TABLE]))


needs_namespaces = pytest.mark.skipif(not can_make_namespaces(), reason="private network namespaces need root")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
          ) -> subprocess.Popen[bytes]:
    """A process in the calling thread's namespace, its output in `log`; stop it with stop()."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                cwd=cwd, start_new_session=True)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
