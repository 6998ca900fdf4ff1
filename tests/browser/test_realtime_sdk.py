"""The official Realtime agents SDK (`@openai/agents-realtime` from npm, unmodified) in Debian's Chromium, its
WebRTC transport pointed at `rtc-agent serve` with an ephemeral key from our client_secrets.

The page is served from another origin (its own port), so the SDK's offer needs the CORS preflight answered, as
for any app that talks to a Realtime server from its own site. The package is installed from the npm registry
by scripts/setup.sh (`npm ci` in tests/browser/realtime_sdk/, from the committed package-lock.json) and bundled
for the page with esbuild here.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from browser_harness import DESKTOP, Server, dump

pytestmark = pytest.mark.browser

SDK_DIR = Path(__file__).parent / "realtime_sdk"
TOKEN = "server-token-for-the-sdk-test"
PAGE_PORT = 18091


@pytest.fixture(scope="module")
def sdk_bundle() -> Path:
    """Bundles the page with the installed SDK (esbuild, from the same package.json)."""
    if not shutil.which("npm"):
        pytest.skip("the agents SDK test needs node and npm (scripts/setup.sh installs them as root)")
    if not (SDK_DIR / "node_modules" / "@openai" / "agents-realtime").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=SDK_DIR, check=True, capture_output=True)
    subprocess.run(["npm", "run", "build"], cwd=SDK_DIR, check=True, capture_output=True)
    return SDK_DIR


@pytest.fixture(scope="module")
def page_origin(net: Any, sdk_bundle: Path) -> Iterator[str]:
    """A plain static server for the page, inside the namespace, on a port (an origin) of its own."""
    proc = subprocess.Popen(net.command([sys.executable, "-m", "http.server", str(PAGE_PORT), "--bind", "127.0.0.1",
                                         "--directory", str(sdk_bundle)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PAGE_PORT}"
    try:
        status, _ = net.http("GET", url + "/index.html", wait_s=20)
        assert status == 200
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def wait(page: Any, expr: str, timeout_s: float) -> None:
    try:
        page.wait_for_function(f"() => ({expr})", timeout=timeout_s * 1000)
    except Exception as exc:
        state = page.evaluate("() => ({errors: sdk.errors, events: sdk.events.slice(-15).map(e => e.type)})")
        raise AssertionError(f"timed out waiting for {expr}; page: {dump(state)}") from exc


def test_agents_sdk_webrtc_transport_speaks_and_hears_the_answer(
        new_page: Callable[..., Any], start_server: Callable[..., Server], net: Any, page_origin: str) -> None:
    server = start_server(18090, "--token", TOKEN, "--max-answer-s", "3")
    status, body = net.http("POST", server.url + "/v1/realtime/client_secrets",
                            headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    key = json.loads(body)["value"]
    assert key.startswith("ek_")

    page = new_page(DESKTOP)
    page.goto(page_origin + "/index.html")
    page.wait_for_function("() => typeof window.startCall === 'function'")
    page.evaluate("([baseUrl, key]) => startCall({baseUrl, key})", [server.url, key])
    assert page.evaluate("() => sdk.connected && sdk.callId && sdk.callId.startsWith('sess_')")
    wait(page, "sdk.events.some(e => e.type === 'response.done')", 60)
    wait(page, "sdk.rtpSteps.filter(s => s === 3840).length >= 5", 10)

    events = page.evaluate("() => sdk.events")
    types = [e["type"] for e in events]
    assert types[0] == "session.created" and "session.updated" in types
    order = [types.index(t) for t in ("input_audio_buffer.speech_started", "input_audio_buffer.committed",
                                      "response.created", "output_audio_buffer.started", "response.done")]
    assert order == sorted(order), types[:40]
    assert all(isinstance(e.get("event_id"), str) for e in events)
    updated = next(e for e in events if e["type"] == "session.updated")["session"]
    assert updated["audio"]["output"]["voice"] == "chelsie"
    assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 400
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert done["output"][0]["content"][0]["transcript"].strip(), done

    audio = page.evaluate("() => inboundAudio()")
    assert audio["packets"] > 20 and audio["energy"] > 0, audio  # the agent's Opus arrived and was not silence
    steps = page.evaluate("() => sdk.rtpSteps")
    # RTP time runs on in whole 10 ms steps (20 and 80 ms packets, 10 ms ones before an answer): it never jumps
    assert all(s % 480 == 0 for s in steps), steps
    assert page.evaluate("() => sdk.errors") == []
    assert server.metric("rtc_agent_active_sessions") == 1
