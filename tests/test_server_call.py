"""Real calls: an aiortc client speaks espeak-ng speech to the real server (tiny model) over loopback."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiortc.mediastreams import VideoStreamTrack

from rtc_agent.client.camera import SyntheticCamera
from rtc_agent.client.microphone import Microphone
from rtc_agent.client.peer import Call

from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import (CALL_TOKENS, TOOLS, RecordingEngine, SeededEngine, caller, engine, metric, metrics_text,
                         needs_espeak, run, say, server, valid_call, wait_ready)

pytestmark = [needs_espeak, pytest.mark.timeout(180)]


def subsequence(wanted: list[str], got: list[str]) -> bool:
    it = iter(got)
    return all(any(g == w for g in it) for w in wanted)


async def wait_state(call, state: str) -> None:
    while (await call.next_event("conversation.state", timeout_s=30))["state"] != state:
        pass


def answer_packets(call, since: float) -> tuple[list[float], list[int], list[np.ndarray]]:
    a = call.audio
    keep = [i for i, t in enumerate(a.times) if t >= since]
    return [a.times[i] for i in keep], [a.pts[i] for i in keep], [a.samples[i] for i in keep]


def test_one_turn_gets_a_spoken_answer_in_80ms_packets_with_events_in_order() -> None:
    async def main() -> None:
        async with server() as (url, _), caller(url) as (call, mic):
            created = await call.next_event("session.created", timeout_s=10)
            assert created["session"]["output_audio"]["packet_ms"] == 80
            spoken_at = await say(call, mic)
            done = (await call.next_event("response.done", timeout_s=30))["response"]
            await asyncio.sleep(0.3)

            types = [m["type"] for _, m in call.events]
            assert subsequence(["session.created", "input_audio_buffer.speech_started",
                                "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                                "response.created", "response.output_audio_transcript.delta", "response.done"], types)
            states = [m["state"] for m in call.events_of("conversation.state")]
            assert states == ["thinking", "speaking", "listening"]
            assert done["status"] == "incomplete" and not done["interrupted"]
            m = done["metrics"]
            assert m["frames"] == m["frames_sent"] > 0 and m["frames_dropped"] == 0
            assert m["ttfp_ms"] is not None and m["ttfp_ms"] > 0
            assert m["audio_s"] == pytest.approx(m["frames_sent"] * 0.08)
            assert "ttfp_ms" in m["engine"]

            # answer audio is one 80 ms frame per packet (RTP step 3840), 20 ms silence packets between
            # answers, 10 ms ones (480) while the answer's first frame is on its way (none if it came within the
            # first such slot); timestamps run on without a jump, and answers are paced at 12.5 packets/s
            pts, decoded = call.audio.pts, call.audio.decoded
            assert np.diff(pts).tolist() == decoded[:-1]
            assert {960, 3840} <= set(decoded) <= {480, 960, 3840}
            first_long = decoded.index(3840)
            short = [i for i, d in enumerate(decoded) if d == 480]
            assert short == list(range(first_long - len(short), first_long))  # right before the answer, only
            times, _, samples = answer_packets(call, spoken_at)
            long = [t for t, d in zip(call.audio.times, decoded) if t >= spoken_at and d == 3840]
            assert len(long) >= m["frames_sent"] + 1  # the answer (zeros fill gaps), then the encoder's flush
            assert 10.0 < (len(long) - 1) / (long[-1] - long[0]) < 15.0
            heard = call.audio.first_sound_after(spoken_at)
            assert heard is not None, "no answer audio arrived"
            loud = sum(1 for s in samples if len(s) and np.max(np.abs(s)) > 1e-3)
            assert loud >= m["frames_sent"] // 2
            assert (await call.packets_received()) >= len(call.audio.pts) - 1

    run(main())


def test_two_turns_then_response_cancel() -> None:
    async def main() -> None:
        async with server(SeededEngine(), max_answer_s=6.0) as (url, _), caller(url) as (call, mic):
            await say(call, mic, "Hello, how are you?")
            first = (await call.next_event("response.done", timeout_s=30))["response"]
            assert first["status"] == "incomplete"
            await say(call, mic, "Tell me a long story about the sea.")
            await wait_state(call, "speaking")
            await asyncio.sleep(0.5)
            call.send({"type": "response.cancel"})
            second = (await call.next_event("response.done", timeout_s=30))["response"]
            assert second["id"] != first["id"]
            assert second["interrupted"] and second["status"] == "cancelled", second
            assert second["metrics"]["frames_sent"] < 6.0 / 0.08
            call.send({"type": "response.cancel"})
            err = await call.next_event("error", timeout_s=10)
            assert err["error"]["code"] == "response_cancel_not_active"

    run(main())


def test_barge_in_cuts_the_answer_and_becomes_the_next_turn() -> None:
    async def main() -> None:
        async with server(SeededEngine(), max_answer_s=8.0) as (url, _), caller(url) as (call, mic):
            await say(call, mic, "Please tell me everything about Paris.")
            await wait_state(call, "speaking")
            await asyncio.sleep(0.8)
            barged_at = await say(call, mic, "Stop, stop, wait a moment please.")
            cut = (await call.next_event("response.done", timeout_s=30))["response"]
            assert cut["interrupted"] and cut["status"] == "cancelled"
            m = cut["metrics"]
            assert m["frames_sent"] < 8.0 / 0.08
            assert m["frames_dropped"] > 0 or m["frames_sent"] < m["frames"] or m["frames"] < 8.0 / 0.08
            # the cut answer's audio stops: nothing of it arrives a few packets after the cut
            cut_at = next(t for t, e in call.events if e["type"] == "response.done")
            assert cut_at < barged_at + 1.0
            starts = call.events_of("input_audio_buffer.speech_started")
            assert len(starts) == 2
            nxt = (await call.next_event("response.done", timeout_s=30))["response"]
            assert nxt["id"] != cut["id"] and nxt["metrics"]["frames_sent"] > 0

    run(main())


def test_push_to_talk_commit_and_bad_messages() -> None:
    async def main() -> None:
        async with server() as (url, _), caller(url) as (call, mic):
            await call.next_event("session.created", timeout_s=10)
            for bad, code in [("not json", "invalid_json"), ('{"type": "bogus.event"}', "unknown_event"),
                              ('{"no_type": 1}', "invalid_json"),
                              ('{"type": "session.update", "session": {"voice": "bob"}}', "invalid_value"),
                              ('{"type": "session.update", "session": {"language": "xx"}}', "invalid_value"),
                              ('{"type": "session.update", "session": {"modalities": []}}', "unknown_parameter"),
                              ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty")]:
                call.channel.send(bad)
                err = await call.next_event("error", timeout_s=10)
                assert err["error"]["code"] == code, bad
            call.send({"type": "session.update", "session": {"turn_detection": None, "voice": "chelsie",
                                                             "language": "zh"}})
            updated = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert updated["turn_detection"] is None and updated["voice"] == "chelsie" and updated["language"] == "zh"

            await say(call, mic)
            await asyncio.sleep(1.0)  # well past the hang-over: push-to-talk waits for the commit
            assert not call.events_of("response.created")
            call.send({"type": "input_audio_buffer.commit"})
            done = (await call.next_event("response.done", timeout_s=30))["response"]
            assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
            assert len(call.events_of("error")) == 7  # nothing else went wrong along the way

    run(main())


def test_function_calls_on_the_events_channel() -> None:
    """Our protocol: tools in session.update; a spoken question answered by a call (tool_choice "required"),
    streamed as argument deltas, valid against its schema and not spoken; its output and response.create bring
    the spoken answer. Two questions: two draws of the babbling model. Bad tool messages get an error each and
    change nothing."""
    async def main() -> None:
        async with server(engine_=engine(CALL_TOKENS), max_answer_s=2.0) as (url, _), caller(url) as (call, mic):
            await call.next_event("session.created", timeout_s=10)
            call.send({"type": "session.update", "session": {"tools": TOOLS, "tool_choice": "required"}})
            updated = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert updated["tools"] == TOOLS and updated["tool_choice"] == "required"
            assert updated["parallel_tool_calls"] is True

            for bad, code in [
                    ({"type": "session.update", "session": {"tools": [{"type": "file_search"}]}}, "unsupported_value"),
                    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f", "parameters": {
                        "type": "object", "properties": {"n": {"type": "integr"}}}}]}},
                     "invalid_value"),
                    ({"type": "session.update", "session": {"tool_choice": {"type": "function", "name": "nope"}}},
                     "invalid_value"),
                    ({"type": "session.update", "session": {"parallel_tool_calls": "yes"}}, "invalid_value"),
                    ({"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                                   "call_id": "call_nope", "output": "{}"}},
                     "invalid_value"),
                    ({"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                                   "call_id": "call_nope", "output": {"ok": 1}}},
                     "invalid_value"),
                    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user"}},
                     "invalid_value"),
                    ({"type": "response.create"}, "response_create_empty")]:
                call.send(bad)
                assert (await call.next_event("error", timeout_s=10))["error"]["code"] == code, bad
            call.send({"type": "session.update", "session": {}})
            same = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert (same["tools"], same["tool_choice"]) == (TOOLS, "required")

            for question in ("Turn up the heating in the back seats.", "Add milk to my shopping list."):
                call.send({"type": "session.update", "session": {"tool_choice": "required"}})
                await call.next_event("session.updated", timeout_s=10)
                mark = len(call.events)
                await say(call, mic, question)
                done = (await call.next_event("response.done", timeout_s=60))["response"]
                assert done["status"] == "completed" and done["function_calls"]
                assert done["metrics"]["frames"] == 0 and not done["transcript"]  # a call is not spoken
                events = [e for _, e in call.events[mark:]]
                for c in done["function_calls"]:
                    valid_call(c["name"], c["arguments"])
                    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                              and e["call_id"] == c["call_id"]]
                    assert "".join(deltas) == c["arguments"]
                    assert [(e["response_id"], e["name"], e["arguments"]) for e in events
                            if e["type"] == "response.function_call_arguments.done"
                            and e["call_id"] == c["call_id"]] == [(done["id"], c["name"], c["arguments"])]

                call.send({"type": "session.update", "session": {"tool_choice": "none"}})
                await call.next_event("session.updated", timeout_s=10)
                for c in done["function_calls"]:
                    call.send({"type": "conversation.item.create", "item": {
                        "type": "function_call_output", "call_id": c["call_id"], "output": '{"done": true}'}})
                call.send({"type": "response.create"})
                spoken = (await call.next_event("response.done", timeout_s=60))["response"]
                assert spoken["status"] == "incomplete" and not spoken["function_calls"]
                assert spoken["metrics"]["frames_sent"] > 0
            assert len(call.events_of("error")) == 8  # nothing else went wrong along the way

    run(main())


def test_metrics_move_with_a_call_and_an_audio_only_call_pays_nothing_for_video() -> None:
    async def main() -> None:
        recorder = RecordingEngine()
        async with server(engine_=recorder) as (url, _):
            await wait_ready(url)  # (the shared engine is warmed up by the first server of the run)
            before = await metrics_text(url)
            for name in ("audio_first_packet_latency_ms_bucket", "gpu_memory_peak_gb", "drop_audio_frame_ratio",
                         "rtc_agent_active_sessions", "rtc_agent_turns_total", "rtc_agent_ready"):
                assert name in before
            assert metric(before, "rtc_agent_ready") == 1.0
            async with caller(url) as (call, mic):
                assert metric(await metrics_text(url), "rtc_agent_active_sessions") == 1.0
                await say(call, mic)
                done = (await call.next_event("response.done", timeout_s=30))["response"]
            after = await metrics_text(url)
            assert done["metrics"]["loop_lag_ms_max"] >= 0  # the event loop's lateness during the turn
            lag_samples = "rtc_agent_event_loop_lag_ms_count"  # one per 50 ms
            assert metric(after, lag_samples) > metric(before, lag_samples)
            assert metric(after, "audio_first_packet_latency_ms_count") == 1.0
            assert metric(after, 'rtc_agent_turns_total{status="completed"}') == 1.0
            assert metric(after, 'rtc_agent_output_frames_total{outcome="sent"}') > 0
            assert metric(after, 'rtc_agent_input_audio_packets_total{outcome="kept"}') > 50  # 20 ms packets
            assert metric(after, 'rtc_agent_input_audio_packets_total{outcome="dropped"}') == 0.0  # loopback: in order
            assert metric(after, "rtc_agent_input_audio_drop_ratio") == 0.0
            assert metric(after, "rtc_agent_sessions_total") == 1.0
            assert metric(after, "rtc_agent_active_sessions") == 0.0
            assert 'rtc_agent_engine_step_ms_count{metric="ttfp_ms"}' in after
            assert metric(after, "rtc_agent_video_frames_received_total") == 0.0  # no video track: no sampler
            assert metric(after, "rtc_agent_video_frames_sampled_total") == 0.0
            [session] = recorder.sessions
            assert session.images == [] and session.pushed  # the audio went in, no image was ever pushed

    run(main())


def test_two_calls_at_once_each_get_their_own_answer_and_video_is_sampled_at_2_fps() -> None:
    async def main() -> None:
        async with server() as (url, app):
            await wait_ready(url)
            video_mic, video_call = Microphone(), Call(url)
            connecting_at = asyncio.get_running_loop().time()  # the video flows from the connection on
            await video_call.connect(video_mic, VideoStreamTrack())
            try:
                async with caller(url, voice="aiden") as (a, mic_a), caller(url) as (b, mic_b):
                    assert a.session_id != b.session_id
                    await asyncio.gather(say(a, mic_a), say(b, mic_b, "Good morning, who are you?"))
                    done_a, done_b = await asyncio.gather(a.next_event("response.done", timeout_s=30),
                                                          b.next_event("response.done", timeout_s=30))
                    for done in (done_a, done_b):
                        assert done["response"]["status"] == "incomplete"
                    assert len(a.events_of("response.created")) == len(b.events_of("response.created")) == 1
                    assert not video_call.events_of("response.created")  # the silent third call heard nothing
                text = await metrics_text(url)
                sampled = metric(text, "rtc_agent_video_frames_sampled_total")
                # the video call has been up for the whole test; 2 fps, give or take the first second. A tick's
                # frame may be kept from a quarter period (0.125 s) before the tick (media.video.FrameGrid).
                elapsed = asyncio.get_running_loop().time() - connecting_at
                assert 2.0 * (elapsed - 1.5) <= sampled <= 2.0 * (elapsed + 0.125) + 1, (sampled, elapsed)
            finally:
                await video_call.hang_up()

    run(main())


async def video_call(url: str, camera: SyntheticCamera) -> Call:
    await wait_ready(url)
    call = Call(url)
    await call.connect(Microphone(), camera)  # the microphone sends silence: the media clock runs
    return call


def test_camera_frames_reach_the_engine_at_2_fps_scaled_and_stamped_with_the_media_clock() -> None:
    async def main() -> None:
        recorder = RecordingEngine()
        async with server(engine_=recorder) as (url, _):
            call = await video_call(url, SyntheticCamera(640, 480, fps=20))
            try:
                await asyncio.sleep(3.0)
                [session] = recorder.sessions
                images, stats = list(session.images), session.video_stats()
                text = await metrics_text(url)
            finally:
                await call.hang_up()
        assert 4 <= len(images) <= 8, images
        assert {shape for _, shape in images} == {(288, 384, 3)}  # 640x480 fits 384x384 as 384x288
        gaps = np.diff([at for at, _ in images])
        assert all(0.3 <= gap <= 0.8 for gap in gaps), gaps  # the media clock moves with the video
        assert stats["frames_received"] >= len(images) - 1  # (the latest may still be on its way in)
        received = metric(text, "rtc_agent_video_frames_received_total")
        sampled = metric(text, "rtc_agent_video_frames_sampled_total")
        assert sampled >= len(images) and received > 3 * sampled, (received, sampled)

    run(main())


def test_video_off_and_on_mid_call_without_renegotiation() -> None:
    async def main() -> None:
        recorder = RecordingEngine()
        async with server(engine_=recorder) as (url, _):
            camera = SyntheticCamera(640, 360, fps=15)
            call = await video_call(url, camera)
            try:
                [sender] = [s for s in call.pc.getSenders() if s.track is camera]
                [session] = recorder.sessions
                await asyncio.sleep(2.0)
                assert len(session.images) >= 2
                sender.replaceTrack(None)  # video off (the page's camera and screen buttons do this)
                await asyncio.sleep(0.5)  # what was on its way arrives
                received = "rtc_agent_video_frames_received_total"
                off, received_off = len(session.images), metric(await metrics_text(url), received)
                await asyncio.sleep(2.0)
                assert len(session.images) == off
                assert metric(await metrics_text(url), received) == received_off
                sender.replaceTrack(camera)  # on again
                await asyncio.sleep(2.0)
                assert len(session.images) >= off + 2
                assert call.pc.signalingState == "stable" and len(recorder.sessions) == 1
                ats = [at for at, _ in session.images]
                assert ats == sorted(ats) and ats[off] - ats[off - 1] > 2.0  # the pause shows on the clock
                assert {shape for _, shape in session.images} == {(224, 384, 3)}
            finally:
                await call.hang_up()

    run(main())
