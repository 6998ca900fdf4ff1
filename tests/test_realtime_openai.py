"""The Realtime API surface (/v1/realtime) driven by the official `openai` Python package, unmodified, against
the real server and tiny model on loopback: the WebSocket (`realtime.connect`) and a WebRTC call
(`realtime.calls.create`, an aiortc peer) authorized by an ephemeral key from `realtime.client_secrets`."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any, AsyncIterator

import aiohttp
import numpy as np
import pytest
from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription

from rtc_agent.client.microphone import Microphone
from rtc_agent.media.inbound import use_low_latency_audio
from rtc_agent.media.pcm import to_pcm16
from rtc_agent.config import TurnSettings
from rtc_agent.engine.events import LIMITS
from rtc_agent.server.protocol import ProtocolError
from rtc_agent.server.realtime import RealtimeError, parse_session
from rtc_agent.server.realtime_http import ClientSecrets
from rtc_agent.server.state import STATE

from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import CALL_TOKENS, LOOPBACK, TOOLS, engine, needs_espeak, run, server, speech, valid_call, wait_ready

openai = pytest.importorskip("openai")
pytestmark = [needs_espeak, pytest.mark.timeout(240)]

TOKEN = "server-token-for-tests"
FRAME_BYTES = 3840  # 80 ms of PCM16 at 24 kHz


def clients(url: str, key: str) -> Any:
    return openai.AsyncOpenAI(api_key=key, base_url=url + "/v1", websocket_base_url=url.replace("http", "ws") + "/v1")


class Recorder:
    """Every server event of one connection, in order, with the answer's audio decoded."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.events: list[Any] = []

    async def until(self, *types: str, timeout_s: float = 60.0) -> Any:
        async def wait() -> Any:
            while True:
                event = await self.conn.recv()
                self.events.append(event)
                if event.type in types:
                    return event
        return await asyncio.wait_for(wait(), timeout_s)

    def of(self, kind: str, since: int = 0) -> list[Any]:
        return [e for e in self.events[since:] if e.type == kind]

    def audio(self, since: int = 0) -> list[bytes]:
        return [base64.b64decode(e.delta) for e in self.of("response.output_audio.delta", since)]


async def speak(conn: Any, text: str, silence_s: float = 1.0) -> None:
    """espeak-ng speech as PCM16 24 kHz, then silence, in 100 ms appends."""
    pcm = to_pcm16(np.concatenate([speech(text, rate=24000), np.zeros(int(24000 * silence_s), np.float32)]))
    for i in range(0, len(pcm), 4800):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 4800]).decode())


def test_websocket_with_the_openai_sdk_speech_text_cancel_barge_in_and_errors() -> None:
    async def main() -> None:
        async with server(max_answer_s=4.0) as (url, _):
            await wait_ready(url)
            async with clients(url, "any-key").realtime.connect(model="tiny") as conn:
                rec = Recorder(conn)
                created = await rec.until("session.created")
                assert created.session.audio.output.voice == "ethan"
                assert created.session.audio.input.format.rate == 24000

                # session.update: voice, instructions, the turn detector's hang-over
                await conn.session.update(session={
                    "type": "realtime", "instructions": "Answer in one word.",
                    "audio": {"output": {"voice": "chelsie"},
                              "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
                updated = await rec.until("session.updated")
                assert updated.session.audio.output.voice == "chelsie"
                assert updated.session.instructions == "Answer in one word."
                assert updated.session.audio.input.turn_detection.silence_duration_ms == 500

                # one spoken question: server VAD ends the turn; audio and transcript come back
                await speak(conn, "What is the weather like in Paris today?")
                started = await rec.until("input_audio_buffer.speech_started")
                stopped = await rec.until("input_audio_buffer.speech_stopped")
                committed = await rec.until("input_audio_buffer.committed")
                assert started.item_id == stopped.item_id == committed.item_id
                assert stopped.audio_end_ms > started.audio_start_ms
                done = (await rec.until("response.done")).response
                # (the tiny model never ends an answer: a limit cuts it, and it says which)
                assert done.status == "incomplete" and done.status_details.reason in LIMITS
                assert done.output[0].status == "incomplete"
                chunks = rec.audio()
                assert chunks and all(len(c) == FRAME_BYTES for c in chunks)
                assert len(chunks) == done.model_extra["metrics"]["frames_sent"]
                samples = np.frombuffer(b"".join(chunks), "<i2").astype(np.float32)
                assert np.abs(samples).max() > 0  # the answer is sound, not silence
                deltas = "".join(e.delta for e in rec.of("response.output_audio_transcript.delta"))
                transcript = rec.of("response.output_audio_transcript.done")[0].transcript
                assert deltas and transcript == deltas == done.output[0].content[0].transcript
                user_item = next(e.item for e in rec.of("conversation.item.added") if e.item.role == "user")
                assert user_item.id == committed.item_id

                # a typed question, cancelled mid-answer, then the heard part truncated
                mark = len(rec.events)
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Tell me a long story about the sea."}]})
                await conn.response.create()
                created_r = await rec.until("response.created")
                for _ in range(3):
                    await rec.until("response.output_audio.delta")
                await conn.response.cancel()
                cancelled = (await rec.until("response.done")).response
                assert cancelled.id == created_r.response.id and cancelled.status == "cancelled"
                assert cancelled.status_details.reason == "client_cancelled"
                assert 3 <= len(rec.audio(mark)) < 4.0 / 0.08
                await conn.conversation.item.truncate(item_id=cancelled.output[0].id, content_index=0,
                                                      audio_end_ms=160)
                truncated = await rec.until("conversation.item.truncated")
                assert truncated.item_id == cancelled.output[0].id and truncated.audio_end_ms == 160

                # barge-in: speech during an answer cuts it, and that speech is the next turn
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Count to twenty."}]})
                await conn.response.create()
                await rec.until("response.created")
                await speak(conn, "Stop, I have another question.")  # (the whole speech in a few milliseconds)
                await rec.until("input_audio_buffer.speech_started")
                cut = (await rec.until("response.done")).response
                assert cut.status == "cancelled" and cut.status_details.reason == "turn_detected"
                assert (await rec.until("response.done")).response.status == "incomplete"  # the next turn's answer

                # push-to-talk: no turn detection; speech waits for commit, then for response.create; clear drops
                # speech not yet committed
                await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
                assert (await rec.until("session.updated")).session.audio.input.turn_detection is None
                await speak(conn, "Hello?", silence_s=0.6)
                await rec.until("input_audio_buffer.speech_stopped")
                await conn.input_audio_buffer.clear()
                await rec.until("input_audio_buffer.cleared")
                await conn.input_audio_buffer.commit()
                assert (await rec.until("error")).error.code == "input_audio_buffer_commit_empty"
                await speak(conn, "What time is it?", silence_s=0.6)
                await conn.input_audio_buffer.commit()
                await rec.until("input_audio_buffer.committed")
                mark = len(rec.events)
                await conn.send({"type": "barrier"})  # events are handled in order: its error comes after the rest
                await rec.until("error")
                assert not rec.of("response.created", mark)  # a commit alone does not answer
                await conn.response.create()
                assert (await rec.until("response.done")).response.status == "incomplete"

                # what this server does not do: an error naming the client's event, and nothing changes
                await conn.send({"type": "conversation.item.delete", "item_id": "x", "event_id": "evt_del"})
                error = (await rec.until("error")).error
                assert (error.code, error.event_id) == ("unknown_event", "evt_del")
                await conn.send({"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "evt_b64"})
                error = (await rec.until("error")).error
                assert (error.code, error.param, error.event_id) == ("invalid_value", "audio", "evt_b64")
                await conn.session.update(session={"type": "realtime", "audio": {"input": {
                    "noise_reduction": {"type": "near_field"}}, "output": {"voice": "aiden"}}})
                error = (await rec.until("error")).error
                assert error.code == "unsupported_value" and error.param == "session.audio.input.noise_reduction"
                await conn.send({"type": "response.cancel"})
                assert (await rec.until("error")).error.code == "response_cancel_not_active"
                await conn.session.update(session={"type": "realtime"})
                assert (await rec.until("session.updated")).session.audio.output.voice == "chelsie"

                ids = [e.event_id for e in rec.events]
                assert all(isinstance(i, str) and i.startswith("event_") for i in ids) and len(set(ids)) == len(ids)

    run(main(), timeout_s=200)


def test_function_calls_over_the_websocket_with_the_openai_sdk() -> None:
    """Two tools; a call required (or a named one) for each question: the call is a function_call item whose
    arguments parse and validate against its schema, streamed as argument deltas; its output goes back and the
    answer goes on, spoken. Three questions on one socket: three draws of the babbling model."""
    async def main() -> None:
        async with server(engine_=engine(CALL_TOKENS), max_answer_s=2.0) as (url, _):
            await wait_ready(url)
            async with clients(url, "any-key").realtime.connect(model="tiny") as conn:
                rec = Recorder(conn)
                await rec.until("session.created")
                await conn.session.update(session={"type": "realtime", "tools": TOOLS, "tool_choice": "required",
                                                   "audio": {"input": {"turn_detection": None}}})
                updated = (await rec.until("session.updated")).session
                assert [t.name for t in updated.tools] == ["set_heating", "add_to_list"]
                assert updated.tools[0].parameters == TOOLS[0]["parameters"] and updated.tool_choice == "required"
                for question, choice in [("Turn up the heating in the back.", "required"),
                                         ("Add milk and eggs to my list.", {"type": "function", "name": "add_to_list"}),
                                         ("Make it warmer and buy bread.", "required")]:
                    await conn.session.update(session={"type": "realtime", "tool_choice": choice})
                    chosen = (await rec.until("session.updated")).session.tool_choice
                    assert (chosen if isinstance(chosen, str) else chosen.model_dump()) == choice
                    mark = len(rec.events)
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_text", "text": question}]})
                    await conn.response.create()
                    done = (await rec.until("response.done")).response
                    assert done.status == "completed" and done.output
                    assert all(item.type == "function_call" for item in done.output)  # no empty message
                    assert not rec.audio(mark) and not rec.of("response.output_audio_transcript.delta", mark)
                    added = rec.of("response.output_item.added", mark)
                    assert [e.output_index for e in added] == list(range(len(done.output)))
                    assert [e.item.id for e in added] == [item.id for item in done.output]
                    for item in done.output:
                        assert item.status == "completed" and item.call_id.startswith("call_")
                        if choice != "required":
                            assert item.name == "add_to_list"
                        valid_call(item.name, item.arguments)
                        deltas = [e for e in rec.of("response.function_call_arguments.delta", mark)
                                  if e.item_id == item.id]
                        assert deltas and "".join(e.delta for e in deltas) == item.arguments
                        assert {(e.call_id, e.response_id) for e in deltas} == {(item.call_id, done.id)}
                        finished = [e for e in rec.of("response.function_call_arguments.done", mark)
                                    if e.item_id == item.id]
                        assert [(e.call_id, e.name, e.arguments) for e in finished] == [
                            (item.call_id, item.name, item.arguments)]
                        assert [e.item for e in rec.of("response.output_item.done", mark)
                                if e.item.id == item.id] == [item]

                    # the results go back, and the answer goes on: spoken (tool_choice "auto": it may speak)
                    await conn.session.update(session={"type": "realtime", "tool_choice": "auto"})
                    await rec.until("session.updated")
                    for item in done.output:
                        await conn.conversation.item.create(item={"type": "function_call_output",
                                                                  "call_id": item.call_id, "output": '{"ok": true}'})
                        result = (await rec.until("conversation.item.done")).item
                        assert (result.type, result.call_id, result.output) == (
                            "function_call_output", item.call_id, '{"ok": true}')
                    answered = item.call_id
                    mark = len(rec.events)
                    await conn.response.create()
                    spoken = (await rec.until("response.done")).response
                    assert spoken.status == "incomplete" and [item.type for item in spoken.output] == ["message"]
                    assert rec.audio(mark)

                # a response cancelled at its first piece of arguments: a call it had finished is reported (it is
                # in the history), a call cut while being written ends incomplete, with no .done and no output
                await conn.session.update(session={"type": "realtime", "tool_choice": "required"})
                await rec.until("session.updated")
                mark = len(rec.events)
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Warmer in the front, please."}]})
                await conn.response.create()
                await rec.until("response.function_call_arguments.delta")
                await conn.response.cancel()
                cut = (await rec.until("response.done")).response
                if cut.status == "completed":  # (it was over before the cancel came)
                    assert (await rec.until("error")).error.code == "response_cancel_not_active"
                assert cut.output and all(item.type == "function_call" for item in cut.output)
                finished = {e.call_id: e.arguments for e in rec.of("response.function_call_arguments.done", mark)}
                for item in cut.output:
                    assert item.status in ("completed", "incomplete")
                    assert (item.status == "completed") == (item.call_id in finished)
                    if item.status == "completed":
                        valid_call(item.name, finished[item.call_id])
                    else:
                        await conn.conversation.item.create(item={"type": "function_call_output",
                                                                  "call_id": item.call_id, "output": "{}"})
                        assert (await rec.until("error")).error.code == "invalid_value"
                await conn.session.update(session={"type": "realtime", "tool_choice": "auto"})
                await rec.until("session.updated")

                # what cannot be done gets an error naming its field, and changes nothing
                for session, code, param in [
                        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "unsupported_value", "session.tools"),
                        ({"tools": [{"type": "function", "name": "f", "parameters": {
                            "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}]},
                         "invalid_value", "session.tools"),
                        ({"tool_choice": {"type": "function", "name": "order_pizza"}}, "invalid_value",
                         "session.tool_choice")]:
                    await conn.session.update(session={"type": "realtime", **session})
                    error = (await rec.until("error")).error
                    assert (error.code, error.param) == (code, param), error
                await conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_made_up",
                                                          "output": "{}"})
                assert (await rec.until("error")).error.code == "invalid_value"
                await conn.conversation.item.create(item={"type": "function_call_output", "call_id": answered,
                                                          "output": "{}"})  # it has its output already
                assert (await rec.until("error")).error.code == "invalid_value"
                await conn.session.update(session={"type": "realtime"})
                same = (await rec.until("session.updated")).session
                assert [t.name for t in same.tools] == ["set_heating", "add_to_list"] and same.tool_choice == "auto"

    run(main(), timeout_s=200)


NOTES = {"type": "function", "name": "take_notes", "description": "Write notes down.", "parameters": {
    "type": "object", "properties": {"list": {"type": "array", "items": {"type": "string"}}}, "required": ["list"]}}


def test_with_the_openai_sdk_calls_on_open_schemas_end_whole_and_a_cut_answer_says_why() -> None:
    """The issue's case: tool_choice "required" and an array of strings without maxLength, six rounds on one
    socket: every call is whole (`.done` comes, its arguments validate) and its response is completed; a written
    answer cut by the token budget is incomplete with reason max_output_tokens, its message item incomplete; the
    language lock goes through the session's `language` extension."""
    import jsonschema

    async def main() -> None:
        async with server(engine_=engine(CALL_TOKENS), max_answer_s=3.0) as (url, _):
            await wait_ready(url)
            async with clients(url, "any-key").realtime.connect(model="tiny") as conn:
                rec = Recorder(conn)
                await rec.until("session.created")
                await conn.session.update(session={"type": "realtime", "tools": [NOTES], "tool_choice": "required",
                                                   "language": "en", "audio": {"input": {"turn_detection": None}}})
                assert (await rec.until("session.updated")).session.model_extra["language"] == "en"
                for _ in range(6):
                    mark = len(rec.events)
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_text", "text": "Note down what we need for the trip."}]})
                    await conn.response.create()
                    done = (await rec.until("response.done")).response
                    assert done.status == "completed" and done.output, done
                    finished = {e.call_id: e.arguments for e in rec.of("response.function_call_arguments.done", mark)}
                    for item in done.output:
                        assert item.type == "function_call" and item.status == "completed"
                        assert finished[item.call_id] == item.arguments
                        jsonschema.validate(json.loads(item.arguments), NOTES["parameters"])
                    for item in done.output:
                        await conn.conversation.item.create(item={"type": "function_call_output",
                                                                  "call_id": item.call_id, "output": "{}"})
                        await rec.until("conversation.item.done")

                await conn.session.update(session={"type": "realtime", "tool_choice": "none",
                                                   "output_modalities": ["text"], "language": None})
                assert (await rec.until("session.updated")).session.model_extra["language"] is None
                await conn.response.create()
                cut = (await rec.until("response.done")).response
                assert cut.status == "incomplete" and cut.status_details.type == "incomplete"
                assert cut.status_details.reason == "max_output_tokens" and cut.output[0].status == "incomplete"
                await conn.session.update(session={"type": "realtime", "language": "tlh"})
                assert (await rec.until("error")).error.code == "invalid_value"

    run(main(), timeout_s=200)


@contextlib.asynccontextmanager
async def realtime_call(url: str, key: str, session: dict[str, Any] | None = None
                        ) -> AsyncIterator[tuple[RTCDataChannel, Microphone, asyncio.Queue[dict[str, Any]], str]]:
    """An aiortc peer with an `oai-events` channel whose offer goes through the SDK's `realtime.calls.create`."""
    from rtc_agent.media.ice import use_host_addresses

    use_host_addresses(LOOPBACK)
    pc, mic, events = RTCPeerConnection(), Microphone(), asyncio.Queue()
    channel = pc.createDataChannel("oai-events")
    channel.on("message", lambda text: events.put_nowait(json.loads(text)))
    opened = asyncio.Event()
    channel.on("open", opened.set)
    pc.addTrack(mic)
    use_low_latency_audio(pc)
    try:
        await pc.setLocalDescription(await pc.createOffer())
        raw = await clients(url, key).realtime.calls.with_raw_response.create(
            sdp=pc.localDescription.sdp, **({"session": session} if session else {}))
        assert raw.status_code == 201 and raw.headers["content-type"].startswith("application/sdp")
        call_id = raw.headers["location"].rsplit("/", 1)[-1]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=raw.content.decode(), type="answer"))
        await asyncio.wait_for(opened.wait(), 20)
        yield channel, mic, events, call_id
    finally:
        await pc.close()


async def next_of(queue: asyncio.Queue[dict[str, Any]], kind: str, seen: list[dict[str, Any]]) -> dict[str, Any]:
    while True:
        event = await asyncio.wait_for(queue.get(), 60)
        seen.append(event)
        if event["type"] == kind:
            return event


def test_webrtc_call_with_a_client_secret_through_the_openai_sdk() -> None:
    async def main() -> None:
        async with server(token=TOKEN, max_answer_s=2.0) as (url, app):
            await wait_ready(url)
            minted = await clients(url, TOKEN).realtime.client_secrets.create(
                expires_after={"anchor": "created_at", "seconds": 60},
                session={"type": "realtime", "instructions": "Be brief.", "audio": {"output": {"voice": "aiden"}}})
            assert minted.value.startswith("ek_") and minted.session.audio.output.voice == "aiden"

            # the key cannot mint keys; a wrong key opens nothing
            with pytest.raises(openai.AuthenticationError):
                await clients(url, minted.value).realtime.client_secrets.create()
            with pytest.raises(openai.AuthenticationError):
                await clients(url, "ek_made_up").realtime.calls.create(sdp="v=0\r\n")

            # the multipart form's session part applies on top of the key's
            async with realtime_call(url, minted.value, {"type": "realtime", "audio": {"input": {
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 450}}}}) as (channel, mic, q,
                                                                                                 call_id):
                seen: list[dict[str, Any]] = []
                created = (await next_of(q, "session.created", seen))["session"]
                assert created["audio"]["output"]["voice"] == "aiden" and created["instructions"] == "Be brief."
                assert created["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 450
                channel.send('{"type": "session.update", "event_id": "e1", "session": {"type": "realtime", '
                                '"tracing": "auto"}}')  # as the agents SDK sends it
                await next_of(q, "session.updated", seen)

                mic.play(speech())
                await next_of(q, "output_audio_buffer.started", seen)
                done = (await next_of(q, "response.done", seen))["response"]
                stopped = await next_of(q, "output_audio_buffer.stopped", seen)
                assert done["status"] == "incomplete" and stopped["response_id"] == done["id"]
                assert done["metrics"]["frames_sent"] > 0
                kinds = [e["type"] for e in seen]
                for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.committed", "response.created",
                             "response.output_item.added", "response.output_audio_transcript.delta"):
                    assert kind in kinds
                assert "response.output_audio.delta" not in kinds  # on WebRTC the audio is RTP
                # the agents SDK's interrupt: the answer's audio cleared mid-way
                mic.play(speech("Tell me more."))
                await next_of(q, "output_audio_buffer.started", seen)
                channel.send('{"type": "output_audio_buffer.clear"}')
                cut = (await next_of(q, "response.done", seen))["response"]
                assert cut["status"] == "cancelled" and cut["status_details"]["reason"] == "client_cancelled"
                assert (await next_of(q, "output_audio_buffer.cleared", seen))["response_id"] == cut["id"]
                assert cut["metrics"]["frames_sent"] < 2.0 / 0.08

                channel.send('{"type": "input_audio_buffer.append", "audio": "", "event_id": "e2"}')
                error = (await next_of(q, "error", seen))["error"]
                assert (error["code"], error["event_id"]) == ("unsupported_event", "e2")
                assert all(e["event_id"].startswith("event_") for e in seen)

                async with aiohttp.ClientSession() as http:  # the call's own hang-up, under its Location
                    async with http.post(f"{url}/v1/realtime/calls/{call_id}/hangup",
                                         headers={"Authorization": f"Bearer {minted.value}"}) as r:
                        assert r.status == 200
                assert len(app[STATE].sessions) == 0

    run(main(), timeout_s=200)


TRANSCRIPTION = {"model": "gpt-4o-transcribe", "language": "en"}  # (the model named is taken and ignored)


@needs_espeak
def test_the_callers_words_through_the_openai_sdk_on_the_websocket_and_a_webrtc_call() -> None:
    """Off by default, as OpenAI's; session.audio.input.transcription turns it on: deltas and the completed
    transcript, with the item's id, in the SDK's own event types; a client secret carries the setting to a WebRTC
    call, whose events come on the data channel."""
    async def main() -> None:
        async with server(token=TOKEN, max_answer_s=1.0) as (url, _):
            await wait_ready(url)
            async with clients(url, TOKEN).realtime.connect(model="tiny") as conn:
                rec = Recorder(conn)
                created = await rec.until("session.created")
                assert created.session.audio.input.transcription is None
                await speak(conn, "Hello there.")
                await rec.until("response.done")
                assert not [e for e in rec.events if "input_audio_transcription" in e.type]

                await conn.session.update(session={"type": "realtime", "audio": {"input": {
                    "transcription": {"model": "whisper-1", "language": "fr"}}}})
                error = (await rec.until("error")).error
                assert (error.code, error.param) == ("unsupported_value", "session.audio.input.transcription.language")
                await conn.session.update(session={"type": "realtime",
                                                   "audio": {"input": {"transcription": TRANSCRIPTION}}})
                updated = await rec.until("session.updated")
                assert updated.session.audio.input.transcription.model == "gpt-4o-transcribe"
                mark = len(rec.events)
                await speak(conn, "What is the weather like in Paris today?")
                committed = await rec.until("input_audio_buffer.committed")
                await rec.until("response.done")
                completed = [e for e in rec.events[mark:]
                             if e.type == "conversation.item.input_audio_transcription.completed"]
                while not completed:
                    completed.append(await rec.until("conversation.item.input_audio_transcription.completed"))
                assert type(completed[0]).__name__ == "ConversationItemInputAudioTranscriptionCompletedEvent"
                assert {e.item_id for e in completed} == {committed.item_id}
                text = " ".join(e.transcript for e in completed).lower()
                assert "weather" in text and "paris" in text, text
                user = next(e.item for e in rec.events[mark:] if e.type == "conversation.item.added"
                            and e.item.role == "user")
                assert user.id == committed.item_id and user.content[0].type == "input_audio"

            minted = await clients(url, TOKEN).realtime.client_secrets.create(session={
                "type": "realtime", "audio": {"input": {"transcription": TRANSCRIPTION}}})
            assert minted.session.audio.input.transcription.model == "gpt-4o-transcribe"
            async with realtime_call(url, minted.value) as (channel, mic, q, _):
                seen: list[dict[str, Any]] = []
                created = (await next_of(q, "session.created", seen))["session"]
                assert created["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe"
                mic.play(speech("Set a timer for ten minutes please."))
                done = await next_of(q, "conversation.item.input_audio_transcription.completed", seen)
                assert "timer" in done["transcript"].lower() and done["content_index"] == 0, done

    run(main(), timeout_s=200)


def test_client_secrets_expire_on_time() -> None:
    now = [1000.0]
    keys = ClientSecrets(clock=lambda: now[0])
    value, secret = keys.mint(10, None)
    assert value.startswith("ek_") and secret.expires_at == 1010
    assert keys.get(value) is secret
    now[0] = 1009.9
    assert keys.get(value) is secret
    now[0] = 1010.0
    assert keys.get(value) is None and keys.get("ek_other") is None


def test_http_errors_cors_and_bad_bodies() -> None:
    async def main() -> None:
        async with server(token=TOKEN) as (url, _):
            await wait_ready(url)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession() as http:
                async with http.options(f"{url}/v1/realtime/calls", headers={
                        "Origin": "http://elsewhere.test", "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "authorization,content-type,x-openai-agents-sdk"}) as r:
                    assert r.status == 204
                    assert r.headers["Access-Control-Allow-Origin"] == "*"
                    assert "x-openai-agents-sdk" in r.headers["Access-Control-Allow-Headers"]
                async with http.post(f"{url}/v1/realtime/calls", data="v=0\r\n",
                                     headers={"Content-Type": "application/sdp"}) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
                    assert r.headers["Access-Control-Allow-Origin"] == "*"
                async with http.post(f"{url}/v1/realtime/calls", data="hello",
                                     headers={**auth, "Content-Type": "application/sdp"}) as r:
                    body = await r.json()
                    assert r.status == 400 and set(body["error"]) == {"message", "type", "code", "param"}
                for sdp in (b"v=0\r\n\xff\r\n", b"v=0\r\na=x:\xed\xa0\x80\r\n"):  # not UTF-8; a surrogate's bytes
                    async with http.post(f"{url}/v1/realtime/calls", data=sdp,
                                         headers={**auth, "Content-Type": "application/sdp"}) as r:
                        assert (r.status, (await r.json())["error"]["code"]) == (400, "invalid_value"), sdp
                async with http.post(f"{url}/v1/realtime/calls", json={"sdp": "v=0"}, headers=auth) as r:
                    assert r.status == 415
                async with http.post(f"{url}/v1/realtime/client_secrets", headers=auth,
                                     json={"expires_after": {"seconds": 5}}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "expires_after.seconds"
                async with http.post(f"{url}/v1/realtime/client_secrets", headers=auth,
                                     json={"session": {"type": "realtime", "tools": [{"type": "function"}]}}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "session.tools"
                async with http.get(f"{url}/v1/realtime?model=tiny") as r:  # no key: no socket
                    assert r.status == 401
                async with http.post(f"{url}/v1/realtime/client_secrets", headers=auth, json={
                        "session": {"type": "realtime", "audio": {"output": {"voice": "aiden"}}}}) as r:
                    key = (await r.json())["value"]
                # a browser's WebSocket carries its key as a subprotocol; the secret's settings apply
                async with http.ws_connect(f"{url}/v1/realtime?model=tiny",
                                           protocols=("realtime", f"openai-insecure-api-key.{key}")) as ws:
                    assert ws.protocol == "realtime"
                    created = await ws.receive_json(timeout=10)
                    assert created["type"] == "session.created"
                    assert created["session"]["audio"]["output"]["voice"] == "aiden"
                async with http.post(f"{url}/v1/realtime/calls/sess_nope/hangup", headers=auth) as r:
                    assert r.status == 404
                async with http.get(f"{url}/v1/models", headers=auth) as r:
                    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"

    run(main(), timeout_s=120)


@pytest.mark.parametrize("session, param", [
    ({"type": "transcription"}, "session.type"),
    ({"audio": []}, "session.audio"),
    ({"audio": {"input": [1]}}, "session.audio.input"),
    ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.output.format"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}},
     "session.audio.input.turn_detection.create_response"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}},
     "session.audio.input.turn_detection.idle_timeout_ms"),
    ({"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
    ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
    ({"prompt": {"id": "pmpt_1"}}, "session.prompt"),
])
def test_session_settings_this_server_cannot_honour_are_refused_by_name(session: dict[str, Any], param: str) -> None:
    with pytest.raises(RealtimeError) as err:
        parse_session(session, TurnSettings())
    assert err.value.param == param


def test_session_settings_map_onto_ours() -> None:
    update = parse_session({"type": "realtime", "model": "gpt-realtime", "tracing": "auto", "instructions": "Hi.",
                            "output_modalities": ["audio"], "tools": [], "audio": {
                                "input": {"format": {"type": "audio/pcm", "rate": 24000}, "transcription": None,
                                          "turn_detection": {"type": "server_vad", "threshold": 0.6,
                                                             "silence_duration_ms": 300, "create_response": True}},
                                "output": {"voice": "aiden", "speed": 1}}}, TurnSettings())
    assert (update.voice, update.instructions, update.text_only) == ("aiden", "Hi.", False)
    assert parse_session({"output_modalities": ["text"]}, TurnSettings()).text_only is True
    assert (update.turn.vad_threshold, update.turn.silence_ms, update.turn.auto) == (0.6, 300, True)
    assert parse_session({"audio": {"input": {"turn_detection": None}}}, TurnSettings()).turn.auto is False
    assert parse_session({"language": "zh"}, TurnSettings()).language == "zh"  # our extension
    assert parse_session({"language": None}, TurnSettings()).language == ""  # (no lock)
    with pytest.raises(ProtocolError):  # our own checks still apply
        parse_session({"audio": {"output": {"voice": "alloy"}}}, TurnSettings())
