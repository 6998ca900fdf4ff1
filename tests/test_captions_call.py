"""Captions of the caller's words in real calls: an aiortc caller speaking espeak-ng speech to the real server and
tiny model over 127.0.0.1, the events on the page's data channel."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from rtc_agent.client.peer import Call

from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import SeededEngine, audio_offer, caller, needs_espeak, run, say, server, wait_ready
from test_server_call import wait_state

COMPLETED = "conversation.item.input_audio_transcription.completed"
TRANSCRIPTION = "conversation.item.input_audio_transcription."


def caption_events(call: Call, since: int = 0) -> list[dict[str, Any]]:
    return [m for _, m in call.events[since:] if m["type"].startswith(TRANSCRIPTION)]


async def caption(call: Call, item_id: str, since: int = 0, timeout_s: float = 30.0) -> str:
    """The item's caption once its last part is in: its parts' completed transcripts, in content_index order
    (the committed event says how many parts there are)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        committed = [m for _, m in call.events[since:] if m["type"] == "input_audio_buffer.committed"
                     and m["item_id"] == item_id]
        done = sorted((m["content_index"], m["transcript"]) for m in caption_events(call, since)
                      if m["type"] == COMPLETED and m["item_id"] == item_id)
        if committed and done and len(done) >= len(committed[0].get("transcripts") or [None]):
            return " ".join(t for _, t in done)
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no caption for {item_id}: {caption_events(call, since)}")


def items_started(call: Call, since: int = 0) -> list[str]:
    return [m["item_id"] for _, m in call.events[since:] if m["type"] == "input_audio_buffer.speech_started"]


@needs_espeak
def test_the_callers_words_are_captioned_on_the_data_channel_and_a_barge_in_too() -> None:
    async def main() -> None:
        async with server(SeededEngine(), max_answer_s=6.0) as (url, _), caller(url) as (call, mic):
            created = (await call.next_event("session.created", timeout_s=10))["session"]
            assert created["input_audio_transcription"]["model"] == "moonshine-base-en"
            assert created["input_audio_transcription_note"] is None

            await say(call, mic, "What is the weather like in Paris today?")
            committed = await call.next_event("input_audio_buffer.committed", timeout_s=20)
            item = committed["item_id"]
            assert items_started(call) == [item]
            text = (await caption(call, item)).lower()
            assert "weather" in text or "paris" in text, text  # (one word may be misheard)
            assert {m["item_id"] for m in caption_events(call)} == {item}

            # speech during the answer cuts it, and is captioned as the next turn
            await wait_state(call, "speaking")
            mark = len(call.events)
            await asyncio.sleep(0.5)
            await say(call, mic, "Stop, tell me about the train to London instead.")
            cut = (await call.next_event("response.done", timeout_s=30))["response"]
            assert cut["status"] == "cancelled"
            barge = items_started(call, mark)
            assert len(barge) == 1 and barge[0] != item
            text = (await caption(call, barge[0], mark)).lower()
            assert "london" in text or "train" in text, text

    run(main(), timeout_s=180)


@needs_espeak
def test_captions_follow_the_offer_and_session_update_and_a_push_to_talk_turn_is_captioned() -> None:
    async def main() -> None:
        async with server() as (url, _), caller(url, captions=False) as (call, mic):
            created = (await call.next_event("session.created", timeout_s=10))["session"]
            assert created["input_audio_transcription"] is None
            await say(call, mic, "Hello, can you hear me?")
            await call.next_event("response.done", timeout_s=30)
            await asyncio.sleep(1.0)
            assert not caption_events(call), caption_events(call)

            call.send({"type": "session.update", "session": {"input_audio_transcription": {"language": "de"}}})
            assert (await call.next_event("error", timeout_s=10))["error"]["code"] == "unsupported_value"
            call.send({"type": "session.update", "session": {"input_audio_transcription": {},
                                                             "turn_detection": None}})
            updated = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert updated["input_audio_transcription"]["model"] == "moonshine-base-en"
            mark = len(call.events)
            await say(call, mic, "Set a timer for ten minutes please.")
            await asyncio.sleep(0.3)
            call.send({"type": "input_audio_buffer.commit"})  # push-to-talk: the commit ends the turn
            committed = await call.next_event("input_audio_buffer.committed", timeout_s=10)
            text = (await caption(call, committed["item_id"], mark)).lower()
            assert "timer" in text or "minutes" in text, text

            call.send({"type": "session.update", "session": {"input_audio_transcription": None}})
            assert (await call.next_event("session.updated", timeout_s=10))["session"][
                "input_audio_transcription"] is None

    run(main(), timeout_s=150)


def test_captions_asked_of_a_server_without_them_are_refused_and_take_no_slot() -> None:
    async def main() -> None:
        async with server(transcription="off") as (url, _):
            await wait_ready(url)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/api/config") as r:
                    assert (await r.json())["input_audio_transcription"] is None
                async with http.get(f"{url}/capacity") as r:
                    free = (await r.json())["free"]
                for _ in range(free + 1):  # more than the slots: none may be kept by a refused offer
                    body = {"type": "offer", "sdp": await audio_offer(), "input_audio_transcription": {}}
                    async with http.post(f"{url}/api/offer", json=body) as r:
                        assert r.status == 400 and (await r.json())["error"]["code"] == "unsupported_value"
                async with http.get(f"{url}/capacity") as r:
                    assert (await r.json())["free"] == free
            async with caller(url) as (call, _):
                created = (await call.next_event("session.created", timeout_s=10))["session"]
                assert created["input_audio_transcription"] is None

    run(main(), timeout_s=120)
