"""Debian's coturn for the tests, on the loopback of the calling thread's private network namespace
(netns_support), checking TURN REST credentials made with SECRET."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import AsyncIterator

import pytest
from aioice.turn import create_turn_endpoint

from rtc_agent.server.turn import turn_credentials

from netns_support import start, stop

SECRET = "test-static-auth-secret"
TURN_PORT = 3478
TURN_URL = f"turn:127.0.0.1:{TURN_PORT}?transport=udp"
needs_coturn = pytest.mark.skipif(shutil.which("turnserver") is None, reason="coturn is not installed (apt)")

@contextlib.asynccontextmanager
async def coturn(log: Path) -> AsyncIterator[None]:
    """coturn on the namespace's loopback, checking credentials with SECRET, until the block ends; 127.0.0.1 peers
    allowed (the agent is on loopback here, which coturn refuses by default)."""
    proc = start(["turnserver", "-n", "--listening-ip=127.0.0.1", f"--listening-port={TURN_PORT}",
                  "--relay-ip=127.0.0.1", "--min-port=49160", "--max-port=49200", "--use-auth-secret",
                  f"--static-auth-secret={SECRET}", "--realm=rtc-agent.test", "--allow-loopback-peers", "--no-cli",
                  "--no-tls", "--no-dtls", "--fingerprint", f"--pidfile={log.with_suffix('.pid')}",
                  f"--userdb={log.with_suffix('.db')}", "--log-file=stdout", "--simple-log"], log)
    try:
        await until_allocates(*turn_credentials(SECRET, 60, "probe"))
        yield
    finally:
        stop(proc)


async def allocate(username: str, password: str) -> None:
    """A TURN allocation on coturn with these credentials (raises when coturn refuses them)."""
    transport, _ = await create_turn_endpoint(asyncio.DatagramProtocol, ("127.0.0.1", TURN_PORT), username,
                                              password, lifetime=60)
    transport.close()


async def until_allocates(username: str, password: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await asyncio.wait_for(allocate(username, password), 2.0)
        except (OSError, asyncio.TimeoutError):  # coturn still starting
            if time.monotonic() > deadline:
                raise

