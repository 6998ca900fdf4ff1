"""A private network namespace for the calling thread, and faults on its loopback.

Linux keeps the network namespace per thread: `private_network()` moves the current thread (the test's event-loop
thread, see rtc_support.run) into a new namespace whose only interface is `lo`. Sockets it opens and processes it
starts (coturn, HAProxy, `rtc-agent serve`) live there, so nothing collides with other tests or reaches outside,
and faults on that `lo` touch only this test's traffic. Needs root (CAP_SYS_ADMIN); tests skip otherwise.

Faults use `tc netem` when the kernel has it. Without it (this sandbox's kernel: "Error: Specified qdisc kind is
unknown."), loss and blackouts fall back to nftables (a random drop of UDP datagrams, a drop of all UDP), and
jitter and reordering cannot be made: `Faults.require_netem()` skips with the kernel's error text.
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
    """Packet faults on the namespace's `lo` (both directions of every call in it). Call from the namespaced thread."""

    def __init__(self) -> None:
        probe = _run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms")
        self.netem_error = None if probe.returncode == 0 else (probe.stderr.strip() or f"tc exit {probe.returncode}")
        if self.netem_error is None:
            _run("tc", "qdisc", "del", "dev", "lo", "root")
        elif shutil.which("nft") is None:
            pytest.skip(f"tc netem is missing ({self.netem_error}) and so is nft (apt package nftables)")
        self.tool = "tc netem" if self.netem_error is None else "nftables"

    def require_netem(self, what: str) -> None:
        if self.netem_error is not None:
            pytest.skip(f"{what} needs tc netem, which this kernel lacks: `tc qdisc add dev lo root netem` said: "
                        f"{self.netem_error}")

    def _netem(self, *args: str) -> None:
        out = _run("tc", "qdisc", "replace", "dev", "lo", "root", "netem", *args)
        assert out.returncode == 0, out.stderr

    def _nft_udp(self, verdict: str) -> None:
        self.clear()
        script = (f"table inet {TABLE} {{\n chain out {{\n type filter hook output priority 0; policy accept;\n"
                  f" meta l4proto udp {verdict}\n }}\n}}\n")
        out = _run("nft", "-f", "-", stdin=script)
        assert out.returncode == 0, out.stderr

    def loss(self, percent: float, jitter_ms: float = 0.0) -> None:
        """Drops `percent` % of packets (each direction), with up to ±jitter_ms of delay variation (netem only)."""
        if jitter_ms:
            self.require_netem(f"{jitter_ms:g} ms of jitter")
        if self.netem_error is None:
            delay = ["delay", f"{jitter_ms:g}ms", f"{jitter_ms:g}ms"] if jitter_ms else []
            self._netem(*delay, "loss", f"{percent:g}%")
        else:
            self._nft_udp(f"numgen random mod 1000 < {round(percent * 10)} drop")

    def reorder(self, percent: float, delay_ms: float = 20.0) -> None:
        """Sends `percent` % of packets at once and delays the rest by delay_ms, so those overtake (netem only)."""
        self.require_netem("reordering")
        self._netem("delay", f"{delay_ms:g}ms", "reorder", f"{percent:g}%")

    def blackout(self) -> None:
        """Drops every media packet (UDP) until clear(); signaling over TCP goes on."""
        if self.netem_error is None:
            self._netem("loss", "100%")
        else:
            self._nft_udp("drop")

    def clear(self) -> None:
        if self.netem_error is None:
            _run("tc", "qdisc", "del", "dev", "lo", "root")
        else:
            _run("nft", "delete", "table", "inet", TABLE)


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
