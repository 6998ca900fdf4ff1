"""Text answers and non-streamed audio through the real server and tiny model, with real aiortc callers and the
`openai` SDK over loopback: `--no-talker` (the server loads no Talker and answers in text on the data channel),
`output_modalities: ["text"]` for one call on a server that speaks, and `--no-audio-stream`."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rtc_agent.server.state import STATE

from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import caller, needs_espeak, run, say, server, wait_ready

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
PACKET_80MS, PACKET_20MS = 3840, 960  # RTP timestamp steps: an answer's packets, the silence between answers


def answer_packets(call, since: int) -> int:
    """80 ms answer packets received after the first `since` packets."""
    return sum(1 for step in call.audio.decoded[since:] if step == PACKET_80MS)


async def set_output(call, modalities: list[str]) -> dict:
    call.send({"type": "session.update", "session": {"output_modalities": modalities}})
    return (await call.next_event("session.updated", "error", timeout_s=10))


def test_without_the_talker_the_server_answers_in_text_on_the_data_channel() -> None:
    async def main() -> None:
        async with server(engine_=None, no_talker=True, max_answer_s=1.0) as (url, app):
            await wait_ready(url)
            engine = app[STATE].engine
            # the loader never built the Talker or Code2Wav: their memory is really not spent
            assert not hasattr(engine.model, "talker") and not hasattr(engine.model, "code2wav")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/api/config") as r:
                    assert (await r.json())["output_modalities"] == ["text"]
            async with caller(url) as (call, mic):
                created = await call.next_event("session.created", timeout_s=10)
                assert created["session"]["output_modalities"] == ["text"]
                refused = await set_output(call, ["audio"])
                assert refused["type"] == "error" and refused["error"]["code"] == "invalid_value"
                assert "--no-talker" in refused["error"]["message"]

                await say(call, mic)
                done = (await call.next_event("response.done", timeout_s=30))["response"]
                text_done = call.events_of("response.output_text.done")
                await asyncio.sleep(0.5)  # the silence packets keep coming after the answer
                after = len(call.audio.decoded)
                await asyncio.sleep(0.3)

        assert done["status"] == "incomplete" and done["output_modalities"] == ["text"]
        deltas = [e["delta"] for e in call.events_of("response.output_text.delta")]
        assert deltas and "".join(deltas) == done["transcript"] != ""
        assert [e["text"] for e in text_done] == [done["transcript"]]
        assert all(e["response_id"] == done["id"] for e in call.events_of("response.output_text.delta"))
        assert call.events_of("response.output_audio_transcript.delta") == []
        m = done["metrics"]
        assert m["frames"] == m["frames_sent"] == 0 and m["ttfp_ms"] is None and m["ttft_ms"] > 0
        assert [e["state"] for e in call.events_of("conversation.state")] == ["thinking", "listening"]
        # the audio track goes on with 20 ms silence packets only: no answer audio, no break in the stream
        assert set(call.audio.decoded) == {PACKET_20MS} and len(call.audio.decoded) > after > 0

    run(main())


def test_output_modalities_text_skips_speech_for_one_call_and_audio_brings_it_back() -> None:
    async def main() -> None:
        async with server(max_answer_s=1.0) as (url, _), caller(url) as (call, mic):
            await call.next_event("session.created", timeout_s=10)
            updated = await set_output(call, ["text"])
            assert updated["type"] == "session.updated" and updated["session"]["output_modalities"] == ["text"]
            before = len(call.audio.decoded)
            await say(call, mic)
            written = (await call.next_event("response.done", timeout_s=30))["response"]
            await asyncio.sleep(0.3)
            spoken_packets_while_text = answer_packets(call, before)

            updated = await set_output(call, ["audio"])
            assert updated["session"]["output_modalities"] == ["audio"]
            before = len(call.audio.decoded)
            await say(call, mic, "And what about tomorrow?")
            spoken = (await call.next_event("response.done", timeout_s=30))["response"]
            await asyncio.sleep(0.3)

            assert written["output_modalities"] == ["text"] and written["status"] == "incomplete"
            assert written["metrics"]["frames"] == 0 and spoken_packets_while_text == 0
            assert "".join(e["delta"] for e in call.events_of("response.output_text.delta")) == \
                written["transcript"] != ""
            assert spoken["output_modalities"] == ["audio"] and spoken["status"] == "incomplete"
            sent = spoken["metrics"]["frames_sent"]
            assert sent > 0 and answer_packets(call, before) >= sent
            transcript = [e for e in call.events_of("response.output_audio_transcript.delta")]
            assert transcript and {e["response_id"] for e in transcript} == {spoken["id"]}

    run(main())


def test_text_output_over_the_realtime_websocket_with_the_openai_sdk() -> None:
    pytest.importorskip("openai")
    from test_realtime_openai import Recorder, clients, speak

    async def main() -> None:
        async with server(max_answer_s=1.0) as (url, _):
            await wait_ready(url)
            async with clients(url, "any-key").realtime.connect(model="tiny") as conn:
                rec = Recorder(conn)
                await rec.until("session.created")
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
                assert (await rec.until("session.updated")).session.output_modalities == ["text"]
                await speak(conn, "What is the weather like in Paris today?")
                done = await rec.until("response.done")

        assert done.response.status == "incomplete" and done.response.output_modalities == ["text"]
        deltas = rec.of("response.output_text.delta")
        [text_done] = rec.of("response.output_text.done")
        assert deltas and "".join(d.delta for d in deltas) == text_done.text != ""
        assert rec.of("response.output_audio.delta") == [] and rec.of("response.output_audio_transcript.delta") == []
        [part] = rec.of("response.content_part.done")
        assert part.part.type == "text" and part.part.text == text_done.text
        assert done.response.output[0].content[0].type == "output_text"
        assert done.response.output[0].content[0].text == text_done.text

    run(main())


def test_no_audio_stream_sends_nothing_before_the_whole_answer_is_made() -> None:
    async def main() -> None:
        async with server(engine_=None, no_audio_stream=True, max_answer_s=1.0) as (url, app):
            await wait_ready(url)
            assert app[STATE].engine.describe()["streaming"] is False
            async with caller(url) as (call, mic):
                await say(call, mic)
                done = (await call.next_event("response.done", timeout_s=30))["response"]
        m = done["metrics"]
        assert done["status"] == "incomplete" and m["frames_sent"] == m["frames"] > 1
        # the first packet went to RTP only after the engine had made the whole answer (its first frame came
        # total_ms after the engine began, which was after the turn ended)
        assert m["ttfp_ms"] >= m["engine"]["total_ms"] > m["engine"]["ttfp_ms"]

    run(main())
