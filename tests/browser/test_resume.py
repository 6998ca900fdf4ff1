"""The page resumes a call whose connection died: all UDP in the namespace is dropped (nftables) mid-call, the page
notices, says it is reconnecting, and comes back over a new peer connection with the resume token from
session.created; the server keeps the conversation (same session, answers numbered on), and no new call is made.
And when the media process that carries the call dies, the page comes back in another one that takes the call
over."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from browser_harness import DESKTOP, Server, metric
from test_call_page import CONNECTED, app, shot, wait

from netns_support import Faults

pytestmark = pytest.mark.browser


def answer_number(response_id: str) -> int:
    return int(response_id.rsplit("_", 1)[1])


def test_the_page_resumes_a_dead_connection_with_the_same_conversation(
        net: Any, new_page: Callable[..., Any], start_server: Callable[..., Server], artifacts: Path) -> None:
    server = start_server(18300)
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call&autostart=1")
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.turns.length >= 1", 45)  # the conversation has an answer before the break
    session_id = app(page, "rtcAgent.call.sessionId")
    last_before = max(answer_number(t["id"]) for t in app(page, "rtcAgent.turns"))
    turns_before = app(page, "rtcAgent.turns.length")

    faults = Faults(net.command)
    faults.blackout()
    blackout_at = time.monotonic()
    try:
        wait(page, "rtcAgent.state === 'reconnecting'", 15)
        noticed_s = time.monotonic() - blackout_at
        alert = page.get_by_role("alert").inner_text()
        assert "Connection lost" in alert and "same conversation" in alert, alert
        assert page.get_by_role("button", name="Hang up").is_visible()  # "Cancel" while it reconnects
        shot(page, artifacts, "call-desktop-resuming")
        # the first attempt meets the dead network too (its ICE gives up after 5 s): the page tries again
        wait(page, "document.getElementById('alert-text').innerText.includes('attempt 2')", 15)
    finally:
        faults.clear()
    network_back = time.monotonic()
    wait(page, f"{CONNECTED} && rtcAgent.lastResumeMs !== null", 30)
    back_s = time.monotonic() - network_back

    assert app(page, "rtcAgent.call.sessionId") == session_id
    assert "reconnected after" in page.locator("#log").inner_text().lower()
    assert not page.locator("#alert").is_visible()
    wait(page, f"rtcAgent.turns.length > {turns_before}", 45)  # the next answer, in the same conversation
    after = app(page, "rtcAgent.turns")[turns_before:]
    assert answer_number(after[0]["id"]) > last_before, after  # a new call would start again at resp_1
    assert app(page, "rtcAgent.events.filter((t) => t === 'session.created').length") == 2
    assert metric(server.metrics(), "rtc_agent_sessions_total") == 1  # one call from start to end
    resume_ms = app(page, "rtcAgent.lastResumeMs")
    print(f"\npage resume: noticed after {noticed_s:.1f} s of blackout; connection lost -> resumed "
          f"{resume_ms / 1000:.1f} s; network back -> resumed {back_s:.1f} s; answers {last_before} -> "
          f"{after[0]['id']}")
    assert resume_ms < 30_000
    shot(page, artifacts, "call-desktop-resumed")


def test_the_page_resumes_in_another_process_when_its_media_process_dies(
        net: Any, new_page: Callable[..., Any], start_server: Callable[..., Server], artifacts: Path) -> None:
    """SIGKILL to the media process that carries the page's call: the page reconnects with its resume token, a live
    process takes the call over from the engine (which kept its session), the transcript says what happened, and
    the conversation goes on there."""
    server = start_server(18310)
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call&autostart=1")
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.turns.length >= 1", 45)
    session_id = app(page, "rtcAgent.call.sessionId")
    turns_before = app(page, "rtcAgent.turns.length")
    status, body = server.get("/readyz")
    assert status == 200, body
    mark = session_id.removeprefix("sess_").split(".")[0]
    [pid] = [p["pid"] for p in json.loads(body)["media_processes"] if p["mark"] == mark]
    os.kill(pid, signal.SIGKILL)

    wait(page, "rtcAgent.state === 'reconnecting'", 15)
    wait(page, f"{CONNECTED} && rtcAgent.lastResumeMs !== null", 45)
    moved_to = app(page, "rtcAgent.call.sessionId")
    assert moved_to != session_id  # a new id, of the process that took the call
    wait(page, "document.getElementById('log').textContent.includes('carried this call stopped')", 10)
    wait(page, f"rtcAgent.turns.length > {turns_before}", 45)  # the conversation goes on there
    assert "exited (-9)" in server.log_text() and "taken over from a media process that died" in server.log_text()
    print(f"\npage resume after its media process died: {app(page, 'rtcAgent.lastResumeMs') / 1000:.1f} s "
          f"({session_id} -> {moved_to})")
    shot(page, artifacts, "call-desktop-moved")
