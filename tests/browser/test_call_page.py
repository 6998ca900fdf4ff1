"""The page (rtc_agent/web/) in Debian's Chromium against `rtc-agent serve`, all inside a loopback-only namespace.

Chromium's fake microphone loops a WAV made by espeak-ng (about 3.4 s of speech, then 3.2 s of silence), so the
caller speaks again every ~7 s: the tiny model's long answers get cut by that barge-in, which the page shows. The
captions tests' Chromium asks browser_harness.QUESTION instead.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from browser_harness import DESKTOP, INSECURE_HOST, PHONE, Server, dump, metric
from rtc_support import TOOLS, valid_call

pytestmark = pytest.mark.browser

IN_CALL = "['listening','hearing','thinking','speaking'].includes(rtcAgent.state)"
CONNECTED = f"window.rtcAgent && rtcAgent.call && rtcAgent.call.sessionId && {IN_CALL}"
TOKEN = "s3cret-t0ken-for-tests"
MS = re.compile(r"^\d+ ms$|^\d+\.\d s$")


def app(page: Any, expr: str) -> Any:
    return page.evaluate(f"() => ({expr})")


def wait(page: Any, expr: str, timeout_s: float = 30) -> None:
    try:
        page.wait_for_function(f"() => ({expr})", timeout=timeout_s * 1000)
    except Exception as exc:
        state = app(page, "window.rtcAgent && {state: rtcAgent.state, events: rtcAgent.events.slice(-12), "
                          "alert: document.getElementById('alert').innerText}")
        raise AssertionError(f"timed out waiting for {expr}; page: {dump(state)}") from exc


def inbound_audio(page: Any) -> dict[str, Any]:
    return page.evaluate("""async () => {
        const s = await rtcAgent.call.inboundAudio();
        return s && {packets: s.packetsReceived, energy: s.totalAudioEnergy, duration: s.totalSamplesDuration};
    }""")


def video_out(page: Any) -> dict[str, Any] | None:
    return page.evaluate("""async () => {
        const s = (await rtcAgent.call.stats()).videoOut;
        return s && {frames: s.framesSent || 0, width: s.frameWidth, height: s.frameHeight};
    }""")


def shot(page: Any, artifacts: Path, name: str) -> None:
    page.screenshot(path=str(artifacts / "screenshots" / f"{name}.png"))


def test_call_connects_and_the_answer_is_heard(new_page: Callable[..., Any], server: Server, artifacts: Path) -> None:
    first_packets_before = metric(server.metrics(), "audio_first_packet_latency_ms_count")
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call")
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.turns.length >= 1", 45)

    events = app(page, "rtcAgent.events")
    assert events[0] == "session.created"
    order = [events.index(t) for t in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                       "response.created", "response.output_audio_transcript.delta",
                                       "response.done")]
    assert order == sorted(order), events[:40]

    audio = inbound_audio(page)
    assert audio["packets"] > 20 and audio["energy"] > 0, audio  # the agent's Opus arrived and was not silence
    turn = app(page, "rtcAgent.turns[0]")
    assert turn["text"].strip(), turn
    assert turn["ttfp_ms"] is not None and turn["ttfp_ms"] >= 0, turn
    assert turn["heard_ms"] is not None and 0 < turn["heard_ms"] < 10_000, turn  # the AudioWorklet heard it

    # Transcript: the caller's turn marker and the agent's words; latency shown on the turn and on the stage.
    assert "Spoke for" in page.locator("#log .turn.user").first.inner_text()  # (under its caption)
    agent = page.locator("#log .turn.agent").first
    assert agent.locator(".text").inner_text().strip() == turn["text"].strip()
    assert "server first packet" in agent.locator(".meta").inner_text()
    assert MS.match(page.locator("#lat-server").inner_text()), page.locator("#latency").inner_text()
    assert MS.match(page.locator("#lat-heard").inner_text()), page.locator("#latency").inner_text()
    if turn["interrupted"]:  # cut by the caller's next utterance (the WAV loops)
        assert "cut" in agent.get_attribute("class")
        assert agent.locator(".cut-tag").inner_text() == "interrupted"
    assert metric(server.metrics(), "audio_first_packet_latency_ms_count") > first_packets_before
    shot(page, artifacts, "call-desktop-in-call-test")
    page.get_by_role("button", name="Hang up").click()


def test_video_reaches_the_server_at_2_fps(new_page: Callable[..., Any], server: Server, artifacts: Path) -> None:
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call&autostart=1&video=1")
    wait(page, CONNECTED, 20)
    wait(page, "document.querySelector('#cam-btn').getAttribute('aria-pressed') === 'true'", 10)
    time.sleep(2)  # let the encoder settle
    name = "rtc_agent_video_frames_sampled_total"
    m0, v0, t0 = server.metric(name), video_out(page), time.monotonic()
    time.sleep(6)
    m1, v1, t1 = server.metric(name), video_out(page), time.monotonic()
    sent_fps = (v1["frames"] - v0["frames"]) / (t1 - t0)
    kept_fps = (m1 - m0) / (t1 - t0)
    assert 1.4 <= sent_fps <= 2.6, (v0, v1)  # the page sends 2 fps (maxFramerate), not the camera's 30
    assert 1.0 <= kept_fps <= 2.6, (m0, m1)  # and the server receives them
    assert max(v1["width"], v1["height"]) <= 640, v1  # low resolution

    page.get_by_role("button", name="Camera", exact=True).click()  # camera off: no more frames
    time.sleep(1.5)
    received = "rtc_agent_video_frames_received_total"
    m2, v2, r2 = server.metric(name), video_out(page), server.metric(received)
    time.sleep(3)
    assert video_out(page)["frames"] == v2["frames"]
    assert server.metric(name) - m2 <= 1 and server.metric(received) - r2 <= 1

    page.get_by_role("button", name="Share screen").click()  # screen share: frames again, same limits
    wait(page, "rtcAgent.screenTrack"
               " && document.querySelector('#screen-btn').getAttribute('aria-pressed') === 'true'", 10)
    time.sleep(1)
    m3, v3, t3 = server.metric(name), video_out(page), time.monotonic()
    time.sleep(3)
    m4, v4, t4 = server.metric(name), video_out(page), time.monotonic()
    share_fps = (v4["frames"] - v3["frames"]) / (t4 - t3)
    assert 1.0 <= share_fps <= 2.7 and m4 > m3, (v3, v4, m3, m4)
    assert max(v4["width"], v4["height"]) <= 640, v4
    page.get_by_role("button", name="Share screen", pressed=True).click()
    (artifacts / "browser" / "video-rates.json").write_text(dump(
        {"camera_sent_fps": sent_fps, "camera_server_kept_fps": kept_fps, "screen_sent_fps": share_fps,
         "camera": v1, "screen": v4}))


def test_hang_up_ends_the_server_session(new_page: Callable[..., Any], server: Server) -> None:
    page = new_page(PHONE)
    page.goto(server.url + "/?mode=voice&autostart=1")
    wait(page, CONNECTED, 20)
    session_id = app(page, "rtcAgent.call.sessionId")
    active = server.metric("rtc_agent_active_sessions")
    assert active >= 1

    # Mid-call settings: voice and instructions go out as session.update; the microphone is re-opened without
    # echo cancellation and noise suppression, and the call goes on.
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("Voice", exact=True).select_option("chelsie")
    page.get_by_label("Instructions").fill("Answer in one short sentence.")
    page.get_by_label("Echo cancellation and noise suppression").uncheck()
    page.get_by_role("button", name="Apply").click()
    wait(page, "rtcAgent.sessionInfo.voice === 'chelsie' && "
               "rtcAgent.sessionInfo.instructions === 'Answer in one short sentence.'", 10)
    wait(page, "rtcAgent.micTrack.getSettings().echoCancellation === false", 10)
    sent = app(page, "rtcAgent.call.audioSender.track === rtcAgent.micTrack")
    assert sent, "the new microphone track is not the one being sent"
    before = inbound_audio(page)["packets"]
    time.sleep(1)
    assert inbound_audio(page)["packets"] > before and app(page, "rtcAgent.call.sessionId") == session_id

    page.keyboard.press("m")  # mute from the keyboard: the track sends silence, the call stays up
    assert app(page, "rtcAgent.micTrack.enabled") is False
    assert page.get_by_role("button", name="Mute microphone").get_attribute("aria-pressed") == "true"
    page.get_by_role("button", name="Mute microphone").click()
    assert app(page, "rtcAgent.micTrack.enabled") is True

    page.get_by_role("button", name="Hang up").click()
    wait(page, "rtcAgent.state === 'ended'", 5)
    deadline = time.monotonic() + 10
    while f"call {session_id} ended (hung up)" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"call {session_id} ended (hung up)" in server.log_text()
    assert server.metric("rtc_agent_active_sessions") == active - 1
    status, _ = server.net.http("DELETE", f"{server.url}/api/sessions/{session_id}")
    assert status == 404  # already gone
    assert page.get_by_role("button", name="Start call").is_visible()


def test_push_to_talk(new_page: Callable[..., Any], server: Server, artifacts: Path) -> None:
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call")
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("Push-to-talk").check()
    page.get_by_label("Voice", exact=True).select_option("aiden")
    page.get_by_role("button", name="Apply").click()
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.sessionInfo && rtcAgent.sessionInfo.voice === 'aiden'", 5)  # sent with the offer
    # The page turned the server's automatic turn-taking off.
    wait(page, "rtcAgent.sessionInfo && rtcAgent.events.includes('session.updated') "
               "&& rtcAgent.sessionInfo.turn_detection === null", 10)
    assert app(page, "rtcAgent.micTrack.enabled") is False  # not held: silence goes out

    ptt = page.get_by_role("button", name="Hold to talk")
    box = ptt.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    assert app(page, "rtcAgent.micTrack.enabled") is True
    wait(page, "rtcAgent.events.includes('input_audio_buffer.speech_stopped')", 20)
    shot(page, artifacts, "call-desktop-push-to-talk-held")
    assert "response.created" not in app(page, "rtcAgent.events")  # no automatic end of turn
    page.mouse.up()
    wait(page, "rtcAgent.events.includes('input_audio_buffer.committed')", 5)
    wait(page, "rtcAgent.events.includes('response.output_audio_transcript.delta')", 20)
    wait(page, "rtcAgent.pending && rtcAgent.pending.heardMs != null", 20)
    assert app(page, "rtcAgent.micTrack.enabled") is False
    assert app(page, "rtcAgent.events.filter(e => e === 'error').length") == 0
    page.get_by_role("button", name="Hang up").click()


def talk_once(page: Any) -> None:
    """One push-to-talk turn: hold the button until the server has heard an utterance end, then let go."""
    heard = app(page, "rtcAgent.events.filter(e => e === 'input_audio_buffer.speech_stopped').length")
    box = page.get_by_role("button", name="Hold to talk").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    wait(page, f"rtcAgent.events.filter(e => e === 'input_audio_buffer.speech_stopped').length > {heard}", 30)
    page.mouse.up()


def set_tools(page: Any, tools: str, choice: str | None = None) -> None:
    """Settings: the tools box (and the tool choice, by its label), then Apply."""
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("Functions the agent may call").fill(tools)
    if choice:
        page.get_by_label("Tool choice").select_option(label=choice)
    page.get_by_role("button", name="Apply").click()


def test_function_calls_are_shown_and_answered(new_page: Callable[..., Any], server: Server,
                                               artifacts: Path) -> None:
    """Two tools and tool_choice "required" from the settings; a spoken question brings a call, streamed into the
    transcript, whose arguments match their schema (jsonschema); its result from the page's box brings the answer
    in words (tool_choice switched to auto). Bad tools JSON, or tools the server refuses, are shown next to the
    box and change nothing."""
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call")
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("Push-to-talk").check()  # one turn at a time: the fake microphone's WAV loops
    page.get_by_role("button", name="Fill in an example").click()  # the tool choice offers each function
    assert len(json.loads(page.get_by_label("Functions the agent may call").input_value())) == 2
    page.get_by_label("Tool choice").select_option(label="add_to_list: every answer calls it")
    page.get_by_role("button", name="Apply").click()
    wait(page, "JSON.parse(localStorage.getItem('rtc-agent.settings')).toolChoice === 'function:add_to_list'", 5)
    set_tools(page, json.dumps(TOOLS), "required: every answer is a call")
    wait(page, "JSON.parse(localStorage.getItem('rtc-agent.settings')).toolChoice === 'required'", 5)
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.sessionInfo.tool_choice === 'required' && rtcAgent.sessionInfo.tools.length === 2", 10)
    assert page.locator("#log .note").filter(has_text="set_heating, add_to_list").count() == 1

    # Not JSON: said next to the box, the dialog stays open, the call goes on with its tools.
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("Functions the agent may call").fill('[{"type": "function", "name": ')
    page.get_by_role("button", name="Apply").click()
    error = page.locator("#tools-error")
    assert error.is_visible() and "Not valid JSON" in error.inner_text(), error.inner_text()
    assert page.get_by_label("Functions the agent may call").get_attribute("aria-invalid") is not None
    assert page.locator("#settings").evaluate("d => d.open")
    before = inbound_audio(page)["packets"]
    time.sleep(1)
    assert inbound_audio(page)["packets"] > before and app(page, CONNECTED)
    page.get_by_role("button", name="Cancel").click()

    # JSON the server refuses (a schema of an unknown type): an alert, the reason next to the box, nothing changed.
    bad = [*TOOLS, {"type": "function", "name": "bad", "parameters": {
        "type": "object", "properties": {"n": {"type": "integr"}}}}]
    set_tools(page, json.dumps(bad))
    alert = page.get_by_role("alert").filter(has_text="The tools were not accepted")
    alert.wait_for()
    assert "tools[2]" in alert.inner_text(), alert.inner_text()
    assert app(page, "rtcAgent.sessionInfo.tool_choice === 'required' && rtcAgent.sessionInfo.tools.length === 2")
    alert.get_by_role("button", name="Settings").click()  # the alert's way to the settings
    assert "The server refused the tools: tools[2]" in error.inner_text(), error.inner_text()
    shot(page, artifacts, "call-desktop-tools-refused")
    page.get_by_label("Functions the agent may call").fill(json.dumps(TOOLS, indent=2))
    page.get_by_role("button", name="Apply").click()
    wait(page, "document.querySelectorAll('#log .note').length >= 4 && "
               "[...document.querySelectorAll('#log .note')].at(-1).textContent.includes('tool choice required')", 10)
    assert not error.is_visible()

    # A spoken question: the answer is a call, streamed into the transcript (retried if the length limit cut it).
    page.evaluate("""() => {
        window.argTexts = [];
        new MutationObserver(() => {
            for (const card of document.querySelectorAll('#log .call'))
                argTexts.push([card.dataset.callId, card.querySelector('.call-args').textContent]);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
    }""")
    for _ in range(3):
        answers = app(page, "rtcAgent.turns.length")
        talk_once(page)
        wait(page, f"rtcAgent.turns.length > {answers}", 90)
        whole = app(page, "[...rtcAgent.calls.values()].filter(c => c.done).map(c => "
                          "({id: c.id, name: c.name, args: c.args, responseId: c.responseId}))")
        if whole:
            break
    assert whole, app(page, "rtcAgent.events.slice(-40)")
    response_id = whole[-1]["responseId"]
    calls = [c for c in whole if c["responseId"] == response_id]
    for call in calls:
        valid_call(call["name"], call["args"])  # parses and matches its tool's schema
        card = page.locator(f'#log .call[data-call-id="{call["id"]}"]')
        assert card.locator(".call-name").inner_text() == call["name"]
        assert card.locator(".call-args").inner_text() == call["args"]
        assert card.locator(".call-status").inner_text() == "done"
        grown = [t for i, t in app(page, "argTexts") if i == call["id"]]
        steps = [t for n, t in enumerate(grown) if t and (n == 0 or t != grown[n - 1])]
        assert len(steps) >= 3 and all(call["args"].startswith(t) for t in steps), steps  # it grew as it came
    events = app(page, "rtcAgent.events")
    assert events.index("response.function_call_arguments.delta") < events.index(
        "response.function_call_arguments.done")
    shot(page, artifacts, "call-desktop-function-call")

    # The developer answers each call of that answer from its box: output, tool_choice auto, then response.create.
    mark = len(app(page, "rtcAgent.events"))
    answers = app(page, "rtcAgent.turns.length")
    for call in calls:
        card = page.locator(f'#log .call[data-call-id="{call["id"]}"]')
        box = card.get_by_label(f"Result of {call['name']}")
        assert box.input_value() == '{"ok": true}'
        box.fill(json.dumps({"ok": True, "call": call["name"]}))
        assert card.get_by_label("Then let the agent answer in words").is_checked()
        card.get_by_role("button", name="Send result").click()
        assert card.locator(".call-status").inner_text() == "result sent"
    wait(page, "rtcAgent.sessionInfo.tool_choice === 'auto'", 10)
    assert page.locator("#tool-choice").input_value() == "auto"
    wait(page, f"rtcAgent.events.slice({mark}).includes('response.created')", 30)
    audio = inbound_audio(page)
    wait(page, f"rtcAgent.events.slice({mark}).includes('response.output_audio_transcript.delta')", 60)
    wait(page, f"rtcAgent.responses.size > {answers} && [...rtcAgent.responses.values()].at(-1).text.trim()", 30)
    time.sleep(1)
    assert inbound_audio(page)["energy"] > audio["energy"]  # the answer is spoken
    assert app(page, "rtcAgent.events.filter(e => e === 'error').length") == 1  # the refused tools only
    shot(page, artifacts, "call-desktop-function-call-answered")
    page.get_by_role("button", name="Hang up").click()


CAPTION = "conversation.item.input_audio_transcription."
# Records each state of the caller's entries: {id, text, provisional (the provisional spans' text), busy}.
WATCH_CAPTIONS = """() => {
    window.captionLog = [];
    new MutationObserver(() => {
        for (const li of document.querySelectorAll('#log li.user[data-item-id]')) {
            const provisional = [...li.querySelectorAll('.text .provisional')].map(s => s.textContent).join(' ');
            const entry = {id: li.dataset.itemId, text: li.querySelector('.text').textContent, provisional,
                           busy: li.getAttribute('aria-busy') === 'true'};
            const last = captionLog.findLast(e => e.id === entry.id);
            if (!last || last.text !== entry.text || last.busy !== entry.busy) captionLog.push(entry);
        }
    }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true, attributes: true});
}"""
# The caller's entries whose caption is final, says the library and is answered (the next entry is the agent's).
ANSWERED_CAPTIONS = """[...document.querySelectorAll('#log li.user.captioned:not([aria-busy])')]
    .filter(li => !li.querySelector('.provisional') && /library/i.test(li.querySelector('.text').textContent)
                  && li.nextElementSibling && li.nextElementSibling.matches('li.agent'))
    .map(li => li.dataset.itemId)"""


def settings_captions(page: Any, on: bool) -> None:
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("Show captions of my words").set_checked(on)
    page.get_by_role("button", name="Apply").click()


def next_answered_turn(page: Any) -> Any:
    """The caller's next entry (after those shown now) once it is over and answered: its locator."""
    shown = app(page, "document.querySelectorAll('#log li.user').length")
    wait(page, f"(li => li && !li.classList.contains('live') && li.nextElementSibling && "
               f"li.nextElementSibling.matches('li.agent'))(document.querySelectorAll('#log li.user')[{shown}])", 90)
    return page.locator("#log li.user").nth(shown)


def test_captions_of_the_callers_words(new_page: Callable[..., Any], asking_browser: Any, server: Server,
                                       artifacts: Path) -> None:
    """The caller's words in their transcript entry, provisional (muted, aria-busy) while they speak, then final,
    above the agent's answer, with how long they spoke under them; turned off in the settings mid-call, the next
    turns have none."""
    page = new_page(DESKTOP, the_browser=asking_browser)
    page.goto(server.url + "/?mode=call")
    page.evaluate(WATCH_CAPTIONS)
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.sessionInfo && rtcAgent.sessionInfo.input_audio_transcription.model", 10)  # on by default
    # Not every utterance gets a delta before its final text: the fake microphone asks again until one has.
    wait(page, f"({ANSWERED_CAPTIONS}).some(id => captionLog.some(e => e.id === id && e.provisional))", 120)
    item = next(i for i in app(page, ANSWERED_CAPTIONS)
                if any(e["id"] == i and e["provisional"] for e in app(page, "captionLog")))
    states = [e for e in app(page, "captionLog") if e["id"] == item]
    assert all(e["busy"] for e in states if e["provisional"]), states
    final = states[-1]  # after the provisional words (the wait above): the final text
    assert not final["provisional"] and not final["busy"] and "library" in final["text"].lower(), states
    entry = page.locator(f'#log li.user[data-item-id="{item}"]')
    assert entry.locator(".text").inner_text() == final["text"]
    assert entry.locator(".meta").inner_text().startswith("Spoke for"), entry.inner_text()
    events = app(page, "rtcAgent.events")
    assert f"{CAPTION}delta" in events and f"{CAPTION}completed" in events, events[-40:]
    shot(page, artifacts, "call-desktop-captions")

    settings_captions(page, False)
    wait(page, "rtcAgent.sessionInfo.input_audio_transcription === null", 10)
    assert page.locator("#log .note").filter(has_text="captions off").count() == 1
    assert app(page, "JSON.parse(localStorage.getItem('rtc-agent.settings')).captions") is False
    off_at = app(page, "rtcAgent.events.lastIndexOf('session.updated')")
    turn = next_answered_turn(page)
    assert turn.locator(".text").inner_text().startswith("Spoke for"), turn.inner_text()
    assert turn.locator(".provisional").count() == 0 and "captioned" not in turn.get_attribute("class")
    late = [e for e in app(page, "rtcAgent.events")[off_at:] if e.startswith(CAPTION)]
    assert not late, late
    assert page.locator("#log li.user[aria-busy]").count() == 0  # no provisional words left anywhere
    page.get_by_role("button", name="Hang up").click()


def test_captions_setting_off_and_on_on_the_phone(new_page: Callable[..., Any], asking_browser: Any,
                                                 server: Server, artifacts: Path) -> None:
    """Off in the settings before the call (saved): the offer asks for none and the turns have none; turned on
    mid-call, the next turns are captioned in the phone layout's transcript."""
    page = new_page(PHONE, the_browser=asking_browser)
    page.goto(server.url + "/?mode=voice")
    settings_captions(page, False)
    page.reload()
    page.get_by_role("button", name="Settings").last.click()
    assert not page.get_by_label("Show captions of my words").is_checked()  # saved with the others
    page.get_by_role("button", name="Cancel").click()
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.sessionInfo && rtcAgent.sessionInfo.input_audio_transcription === null", 10)  # the offer's
    turn = next_answered_turn(page)
    assert turn.locator(".text").inner_text().startswith("Spoke for"), turn.inner_text()
    assert not [e for e in app(page, "rtcAgent.events") if e.startswith(CAPTION)]

    settings_captions(page, True)
    wait(page, "rtcAgent.sessionInfo.input_audio_transcription !== null", 10)
    assert page.locator("#log .note").filter(has_text="captions on").count() == 1
    wait(page, f"({ANSWERED_CAPTIONS}).length > 0", 90)
    assert page.locator("#log li.user.captioned").first.is_visible()
    shot(page, artifacts, "voice-phone-captions")
    page.get_by_role("button", name="Hang up").click()


def test_kiosk_shows_the_caption_line(new_page: Callable[..., Any], asking_browser: Any, server: Server,
                                      artifacts: Path) -> None:
    """The car's layout has no transcript: the caller's last words show large on the stage."""
    page = new_page({"width": 1024, "height": 600}, the_browser=asking_browser)
    page.goto(server.url + "/?mode=kiosk")  # starts by itself
    wait(page, CONNECTED, 20)
    line = page.locator("#kiosk-caption")
    wait(page, "/library/i.test(document.getElementById('kiosk-caption').textContent)", 90)
    assert line.is_visible()
    shot(page, artifacts, "kiosk-car-caption")
    assert not page.locator("#log").is_visible()


def test_turn_setting_and_the_tiny_model_note(new_page: Callable[..., Any], server: Server) -> None:
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call")
    # the server runs the babbling tiny model: the page says so once its /api/config fetch is back (after `load`)
    page.locator("#model-note").wait_for(state="visible", timeout=10_000)
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("When is my turn over?").select_option("semantic_vad:low")
    page.get_by_role("button", name="Apply").click()
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.sessionInfo && rtcAgent.events.includes('session.updated') "
               "&& rtcAgent.sessionInfo.turn_detection.type === 'semantic_vad' "
               "&& rtcAgent.sessionInfo.turn_detection.eagerness === 'low'", 10)
    page.get_by_role("button", name="Settings").last.click()
    page.get_by_label("When is my turn over?").select_option("server_vad")
    page.get_by_role("button", name="Apply").click()
    wait(page, "rtcAgent.sessionInfo.turn_detection.type === 'server_vad'", 10)
    assert app(page, "rtcAgent.events.filter(e => e === 'error').length") == 0
    page.get_by_role("button", name="Hang up").click()


def test_denied_microphone_says_what_to_do(new_page: Callable[..., Any], launch: Callable[..., Any],
                                           server: Server, artifacts: Path) -> None:
    denying = launch(deny_media=True)
    page = new_page(DESKTOP, the_browser=denying)
    page.goto(server.url + "/?mode=call")
    page.get_by_role("button", name="Start call").click()
    alert = page.get_by_role("alert")
    alert.wait_for()
    assert "Microphone access is blocked" in alert.inner_text()
    assert "Allow the microphone" in alert.inner_text()
    assert page.get_by_role("button", name="Try again").first.is_visible()
    assert app(page, "rtcAgent.state") == "error" and app(page, "rtcAgent.call") is None
    shot(page, artifacts, "call-desktop-mic-denied")


def test_no_microphone_and_insecure_page(new_page: Callable[..., Any], launch: Callable[..., Any],
                                         server: Server, artifacts: Path) -> None:
    bare = launch(fake_devices=False)  # the machine has no microphone at all
    page = new_page(PHONE, the_browser=bare)
    page.goto(server.url + "/?mode=voice")
    page.get_by_role("button", name="Start call").click()
    page.get_by_role("alert").wait_for()
    assert "No microphone found" in page.get_by_role("alert").inner_text()

    page = new_page(PHONE)  # a phone opening http://<LAN address>: no secure context, no getUserMedia
    page.goto(f"http://{INSECURE_HOST}:{server.port}/?mode=voice")
    page.get_by_role("alert").wait_for()
    assert "This page needs HTTPS" in page.get_by_role("alert").inner_text()
    assert "--self-signed" in page.get_by_role("alert").inner_text()
    shot(page, artifacts, "voice-phone-not-https")


def test_full_server_and_token(new_page: Callable[..., Any], start_server: Callable[..., Server],
                               artifacts: Path) -> None:
    server = start_server(18081, "--max-sessions", "1", "--token", TOKEN)
    first = new_page(PHONE)
    first.goto(f"{server.url}/?mode=voice&autostart=1&token={TOKEN}")
    wait(first, CONNECTED, 20)
    assert "token" not in first.url  # out of the address bar (history, screenshots, shared links)

    second = new_page(PHONE)
    second.goto(f"{server.url}/?mode=voice&token={TOKEN}")
    second.get_by_role("button", name="Start call").click()
    alert = second.get_by_role("alert")
    alert.wait_for()
    assert "The agent is busy" in alert.inner_text()
    assert "Try again in 10 s" in alert.inner_text()  # the server's Retry-After
    shot(second, artifacts, "voice-phone-server-full")

    wrong = new_page(PHONE)
    wrong.goto(f"{server.url}/?mode=voice&token=not-{TOKEN}")
    wrong.get_by_role("alert").wait_for()
    assert "access token was not accepted" in wrong.get_by_role("alert").inner_text()
    shot(wrong, artifacts, "voice-phone-bad-token")
    first.get_by_role("button", name="Hang up").click()
    wait(first, "rtcAgent.state === 'ended'", 5)
    wrong.get_by_label("Access token").fill(TOKEN)
    wrong.get_by_role("button", name="Use token").click()
    wait(wrong, CONNECTED, 20)
    wrong.get_by_role("button", name="Hang up").click()
    assert TOKEN not in server.log_text()


def test_kiosk_reconnects_after_the_server_restarts(new_page: Callable[..., Any],
                                                    start_server: Callable[..., Server], artifacts: Path) -> None:
    server = start_server(18082)
    page = new_page({"width": 1024, "height": 600})
    page.goto(server.url + "/?mode=kiosk")  # starts by itself
    wait(page, CONNECTED, 20)
    first_id = app(page, "rtcAgent.call.sessionId")
    desk = new_page(DESKTOP)  # a desktop call on the same server says so and offers to reconnect
    desk.goto(server.url + "/?mode=call&autostart=1")
    wait(desk, CONNECTED, 40)  # (12-25 s on a slow 2-core machine while the kiosk's call talks)
    server.stop()
    wait(page, "rtcAgent.state === 'reconnecting'", 20)  # both try to resume their calls first
    wait(desk, "rtcAgent.state === 'reconnecting'", 20)
    shot(page, artifacts, "kiosk-car-reconnecting")
    server.start()  # a new process: it has neither call, so the resumes are refused
    wait(page, f"{CONNECTED} && rtcAgent.call.sessionId !== {first_id!r}", 60)  # the kiosk makes a new call
    wait(desk, "rtcAgent.state === 'error'", 60)  # the desktop page says the call ended and offers a new one
    assert "Connection lost" in desk.get_by_role("alert").inner_text()
    assert desk.get_by_role("button", name="Reconnect").is_visible()
    shot(desk, artifacts, "call-desktop-connection-lost")
    assert page.get_by_role("button", name="Hang up").is_visible()
    assert not page.locator("#alert").is_visible()


def test_mode_is_remembered(new_page: Callable[..., Any], server: Server) -> None:
    page = new_page(PHONE)
    page.goto(server.url + "/?mode=voice")
    assert page.locator("html").get_attribute("data-mode") == "voice"
    page.goto(server.url + "/")
    assert page.locator("html").get_attribute("data-mode") == "voice"
    assert not page.locator("#cam-btn").is_visible()  # the phone layout has no camera
    page.keyboard.press("Tab")  # keyboard: the skip link comes first, then the controls
    assert page.evaluate("document.activeElement.className") == "skip"


@pytest.mark.parametrize("mode", ["call", "voice", "kiosk"])
@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_screenshots(new_page: Callable[..., Any], server: Server, artifacts: Path, mode: str, size: str) -> None:
    """Each mode at desktop and phone sizes, before and during a call (look at them: artifacts/screenshots)."""
    page = new_page(DESKTOP if size == "desktop" else PHONE)
    page.goto(f"{server.url}/?mode={mode}" + ("&video=1" if mode == "call" else ""))
    if mode != "kiosk":
        page.wait_for_load_state("networkidle")
        time.sleep(0.3)
        shot(page, artifacts, f"{mode}-{size}-idle")
        page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.turns.length >= 1"
               " || rtcAgent.events.filter(e => e.endsWith('transcript.delta')).length > 12", 30)
    time.sleep(0.5)
    shot(page, artifacts, f"{mode}-{size}-in-call")
    if mode == "call":
        page.get_by_role("button", name="Settings").last.click()
        time.sleep(0.3)
        shot(page, artifacts, f"{mode}-{size}-settings")
        page.keyboard.press("Escape")


# ---- a server without the Talker and without captions: the last tests of the file, so that it runs beside the
# shared server only (each server is four processes of 0.8-1.3 GB)
@pytest.fixture(scope="module")
def text_server(servers: Any) -> Iterator[Server]:
    """`--no-talker --transcription off`: it answers in writing and makes no captions, for the tests of either (one
    start of a server instead of two: 15-25 s each here)."""
    log = servers.artifacts / "browser" / "server-18110.log"
    log.unlink(missing_ok=True)
    server = Server(servers.net, 18110, log, "--no-talker", "--transcription", "off").start()
    yield server
    server.stop()


def test_captions_setting_without_a_recogniser(new_page: Callable[..., Any], text_server: Server) -> None:
    """A server that makes no captions (/api/config says null): the setting is off, cannot be turned on, and says
    why; its calls have none."""
    server = text_server
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call")
    page.get_by_role("button", name="Settings").last.click()
    box = page.get_by_label("Show captions of my words")
    wait(page, "document.getElementById('captions').disabled", 10)  # once /api/config is in
    assert not box.is_checked()
    help_text = page.locator("#captions-help")
    assert help_text.is_visible() and "no captions" in help_text.inner_text()
    assert box.get_attribute("aria-describedby") == "captions-help"
    page.get_by_role("button", name="Apply").click()
    assert app(page, "JSON.parse(localStorage.getItem('rtc-agent.settings')).captions") is True  # (saved)
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.sessionInfo && rtcAgent.sessionInfo.input_audio_transcription === null", 10)
    page.get_by_role("button", name="Hang up").click()


def test_text_mode_shows_the_written_answer(new_page: Callable[..., Any], text_server: Server, artifacts: Path) -> None:
    server = text_server
    page = new_page(DESKTOP)
    page.goto(server.url + "/?mode=call")
    note = page.locator("#text-mode-note")
    note.wait_for(state="visible")  # the page says so before the call: /api/config's output_modalities
    assert "Text mode" in note.inner_text() and "answers in writing" in note.inner_text()
    page.get_by_role("button", name="Start call").click()
    wait(page, CONNECTED, 20)
    wait(page, "rtcAgent.turns.length >= 1", 40)
    turn = app(page, "rtcAgent.turns[0]")
    shown = page.locator("li.agent .text").first.inner_text()
    shot(page, artifacts, "call-desktop-text-mode")
    page.get_by_role("button", name="Hang up").click()
    assert turn["text"].strip() and turn["frames"] == 0 and shown == turn["text"].strip()
    assert app(page, "rtcAgent.textMode && document.documentElement.dataset.output === 'text'")
    assert app(page, "rtcAgent.events.includes('response.output_text.delta')")
    assert "first text" in page.locator("li.agent .meta").first.inner_text()
    assert MS.match(page.locator("#lat-text").inner_text())  # the latency chip shows the time to the first text
