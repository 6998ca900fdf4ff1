"""The turn state machine without a network: the real tiny engine and the real Opus track, fed 32 ms chunks.

The speech probabilities are scripted here (instead of silero's) so that the edge cases are exact: a false
start, a pause shorter than the hang-over, push-to-talk."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import numpy as np
import pytest
from rtc_support import CALL_TOKENS, TOOLS, RecordingSession, engine, run, valid_call

from rtc_agent.config import TurnSettings
from rtc_agent.conversation import MAX_PUSHES_IN_FLIGHT, Conversation, ConversationError, State
from rtc_agent.engine import SessionOptions
from rtc_agent.engine.step.tools import Tool, ToolSet
from rtc_agent.media.end_of_turn import EndOfTurnModel, EndOfTurnScorer
from rtc_agent.media.outbound import OutboundAudioTrack
from rtc_agent.media.vad import CHUNK_MS, CHUNK_SAMPLES

pytestmark = pytest.mark.timeout(120)
TURN = TurnSettings(turn_detection="server_vad", silence_ms=10 * CHUNK_MS, min_speech_ms=4 * CHUNK_MS,
                    barge_in_ms=8 * CHUNK_MS, prefix_padding_ms=3 * CHUNK_MS)
# Seeded: unseeded, the random tiny Talker ends an answer (codec EOS) within its first 6 frames now and then (1 in
# 60 runs of one test here), and the tests that check an answer's frames would fail with it.
SHORT = SessionOptions(max_frames=6, max_answer_tokens=8, seed=0)


class Script:
    """Speech probability per chunk, set by the test."""

    def __init__(self) -> None:
        self.p = 0.0

    def __call__(self, chunk: np.ndarray) -> float:
        return self.p


async def started(turn: TurnSettings = TURN, options: SessionOptions = SHORT, answer_tokens: int = 32,
                  end_of_turn: EndOfTurnScorer | None = None
                  ) -> tuple[Conversation, Script, list[dict[str, Any]], asyncio.Task]:
    events: list[dict[str, Any]] = []
    script = Script()
    track = OutboundAudioTrack()
    session = RecordingSession(engine(answer_tokens).new_session(options))
    conv = Conversation(session, track, lambda event: events.append(event.as_json()), script, turn,
                        end_of_turn=end_of_turn)  # (the events as the page gets them)

    async def play() -> None:  # what aiortc's sender does: ask for packets forever
        while True:
            await track.recv()

    return conv, script, events, asyncio.create_task(play())


async def feed(conv: Conversation, script: Script, p: float, chunks: int) -> None:
    rng = np.random.default_rng(0)
    script.p = p
    for _ in range(chunks):
        conv.feed((rng.standard_normal(CHUNK_SAMPLES) * (0.1 if p > 0.5 else 0.001)).astype(np.float32))
        await asyncio.sleep(CHUNK_MS / 1000 / 8)  # faster than real time; the engine keeps up


async def until(events: list[dict[str, Any]], kind: str, timeout_s: float = 30.0) -> dict[str, Any]:
    for _ in range(int(timeout_s * 50)):
        found = [e for e in events if e["type"] == kind]
        if found:
            return found[-1]
        await asyncio.sleep(0.02)
    raise TimeoutError(kind)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events if e["type"] != "response.output_audio_transcript.delta"]


def test_false_start_is_dropped_then_a_turn_with_a_short_pause_is_one_turn() -> None:
    async def main() -> None:
        conv, script, events, player = await started()
        try:
            await feed(conv, script, 0.9, 2)  # a click: shorter than min_speech
            await feed(conv, script, 0.1, 12)
            await asyncio.sleep(0.2)
            assert events == [] and conv.state == State.LISTENING
            with pytest.raises(ValueError, match="no caller audio"):  # the engine really dropped it
                async for _ in conv.session.respond():
                    pass

            await feed(conv, script, 0.9, 10)
            await feed(conv, script, 0.1, 6)  # a pause shorter than the hang-over (the answer is prepared at 5)
            await feed(conv, script, 0.9, 10)
            await feed(conv, script, 0.1, 12)
            done = (await until(events, "response.done"))["response"]
            assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] == 6  # (max_frames: 6)
            assert done["status_details"] == {"type": "incomplete", "reason": "max_output_duration"}
            # all of the turn went in, the pause's silence too once the caller went on; of the silence after
            # it only the 5 chunks up to the prepared answer, the rest of the hang-over is left out
            assert audio_runs(conv.session.pushed) == [pytest.approx((0.0, 1.44))]  # (from the click on)
            assert done["metrics"]["engine"]["ready_before_ms"] > 0  # prepared during the hang-over
            assert kinds(events) == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                     "conversation.state", "input_audio_buffer.committed", "response.created",
                                     "conversation.state", "response.done", "conversation.state"]
            assert [e["state"] for e in events if e["type"] == "conversation.state"] == \
                ["thinking", "speaking", "listening"]
        finally:
            player.cancel()
            await conv.close()

    run(main())


def test_the_audio_just_before_a_preparation_goes_to_the_engine_as_urgent() -> None:
    """The caller paused: the preparation is urgent, and so is the audio queued before it (the turn's last words),
    or the preparation would wait for it behind other calls' ordinary work. Audio with no preparation after it is
    ordinary."""
    rng = np.random.default_rng(0)

    def at_once(conv: Conversation, script: Script, p: float, chunks: int) -> None:
        """Chunks with no await in between: the conversation's engine worker finds all of them queued."""
        script.p = p
        for _ in range(chunks):
            conv.feed((rng.standard_normal(CHUNK_SAMPLES) * (0.1 if p > 0.5 else 0.001)).astype(np.float32))

    async def main() -> None:
        conv, script, events, player = await started()
        try:
            at_once(conv, script, 0.9, 10)
            at_once(conv, script, 0.1, 6)  # the answer is prepared at the 5th chunk of silence
            await asyncio.sleep(0.5)
            assert conv.session.urgent_audio == [0.0]  # all of it up to the preparation, in one urgent push
            await feed(conv, script, 0.9, 10)  # the caller goes on: pushed as it comes, nothing prepared after it
            await asyncio.sleep(0.5)
            assert conv.session.urgent_audio == [0.0]
            at_once(conv, script, 0.1, 12)
            done = (await until(events, "response.done"))["response"]
            assert done["status"] == "incomplete"
            assert conv.session.urgent_audio == [0.0, pytest.approx(26 * CHUNK_MS / 1000)]  # the 5 chunks of silence
            assert audio_runs(conv.session.pushed) == [pytest.approx((0.0, 31 * CHUNK_MS / 1000))]
        finally:
            player.cancel()
            await conv.close()

    run(main())


def test_a_pause_asks_for_the_preparation_while_the_engine_has_not_taken_the_audio_in() -> None:
    """The engine's worker is busy (many callers at once): the call's audio pushes wait there, and the
    conversation, at MAX_PUSHES_IN_FLIGHT, waits for room before it pushes more. The caller's pause still asks for
    the answer's preparation at once and the turn's end for the answer (the engine runs a session's calls in order,
    and makes its queued audio as urgent as the preparation); the answer then comes as usual."""
    rng = np.random.default_rng(2)

    async def main() -> None:
        conv, script, events, player = await started()
        hold = contextlib.ExitStack()
        hold.enter_context(conv.session.session.engine._worker.held())
        try:
            script.p = 0.9
            for _ in range(12):  # each chunk its own push: the engine takes none of them in
                conv.feed((rng.standard_normal(CHUNK_SAMPLES) * 0.1).astype(np.float32))
                await asyncio.sleep(0.01)
            calls = conv.session.calls
            assert calls.count("push") == MAX_PUSHES_IN_FLIGHT and "pushed" not in calls
            script.p = 0.1
            for _ in range(12):
                conv.feed((rng.standard_normal(CHUNK_SAMPLES) * 0.001).astype(np.float32))
                await asyncio.sleep(0.01)
            assert "prepare" in calls and "respond" in calls and "pushed" not in calls
            hold.close()
            done = (await until(events, "response.done"))["response"]
            assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] == 6
            assert audio_runs(conv.session.pushed) == [pytest.approx((0.0, 17 * CHUNK_MS / 1000))]
        finally:
            hold.close()
            player.cancel()
            await conv.close()

    run(main())


def test_an_answer_asked_for_while_it_is_being_prepared_starts_from_that_preparation() -> None:
    """The turn ends before the engine has its answer ready: the preparation is asked for without waiting for the
    turn's last audio push to return, the answer without waiting for the preparation, and the engine starts the
    prepared answer (a fresh one would have no `ready_before_ms`)."""
    rng = np.random.default_rng(1)

    async def main() -> None:
        conv, script, events, player = await started(dataclasses.replace(TURN, silence_ms=6 * CHUNK_MS))
        try:
            for p, chunks in ((0.9, 10), (0.1, 8)):  # no await in between: the whole turn is queued at once
                script.p = p
                for _ in range(chunks):
                    conv.feed((rng.standard_normal(CHUNK_SAMPLES) * (0.1 if p > 0.5 else 0.001)).astype(np.float32))
            done = (await until(events, "response.done"))["response"]
            assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] == 6
            calls = conv.session.calls
            assert [c for c in calls if c not in ("push", "pushed")] == ["prepare", "respond", "prepared"]
            # the turn's audio went in one push, and the preparation was asked for before its reply
            assert calls.index("push") < calls.index("prepare") < calls.index("pushed")
            assert done["metrics"]["engine"]["ready_before_ms"] >= 0
            assert done["metrics"]["audio_in_parts"]["prepare"][2] > done["metrics"]["audio_in_ms"]
        finally:
            player.cancel()
            await conv.close()

    run(main())


def test_semantic_vad_prepares_the_answer_at_a_pauses_first_silent_chunk_and_speech_after_it_undoes_that() -> None:
    """semantic_vad (default eagerness, the real Smart Turn model on this CPU): the answer is made ready at the
    first silent chunk of a pause, one chunk before the first verdict is asked, so that the engine has two chunks
    of time before the turn can end; speech right after that chunk undoes it and the chunk stays in the turn."""
    scorer = EndOfTurnScorer(EndOfTurnModel())
    semantic = TurnSettings(min_speech_ms=4 * CHUNK_MS, prefix_padding_ms=3 * CHUNK_MS)
    assert semantic.turn_detection == "semantic_vad" and semantic.eagerness == "auto"

    async def main() -> None:
        conv, script, events, player = await started(semantic, end_of_turn=scorer)
        calls = conv.session.calls
        try:
            await feed(conv, script, 0.9, 10)
            await feed(conv, script, 0.1, 1)
            for _ in range(500):  # (a preparation asked any later would never come: no more chunks are fed)
                if "prepared" in calls:
                    break
                await asyncio.sleep(0.02)
            assert calls.count("prepare") == calls.count("prepared") == 1
            await feed(conv, script, 0.9, 10)
            await feed(conv, script, 0.1, 100)  # longer than semantic_vad's longest wait
            done = (await until(events, "response.done"))["response"]
            assert done["status"] == "incomplete" and done["metrics"]["end_of_turn"]["type"] == "semantic_vad"
            assert calls.count("prepare") == 2
            # the pause's chunk joined the turn; of the silence at its end only the first chunk went in
            assert audio_runs(conv.session.pushed) == [pytest.approx((0.0, 22 * CHUNK_MS / 1000))]
            assert done["metrics"]["engine"]["ready_before_ms"] > 0
        finally:
            player.cancel()
            await conv.close()

    run(main())


def test_push_to_talk_waits_for_commit_and_short_sounds_do_not_barge_in() -> None:
    async def main() -> None:
        conv, script, events, player = await started(dataclasses.replace(TURN, auto=False))
        try:
            with pytest.raises(ConversationError) as empty:
                conv.commit()
            assert empty.value.code == "input_audio_buffer_commit_empty"
            await feed(conv, script, 0.9, 10)
            await feed(conv, script, 0.1, 30)  # long silence: no answer without a commit
            assert "response.created" not in kinds(events)
            conv.commit()
            await until(events, "response.created")
            with pytest.raises(ConversationError):
                conv.commit()  # an answer is in progress
            await feed(conv, script, 0.9, 5)  # "mm-hm": shorter than barge_in_ms
            await feed(conv, script, 0.1, 12)
            done = (await until(events, "response.done"))["response"]
            assert done["status"] == "incomplete"
            assert kinds(events).count("input_audio_buffer.speech_started") == 1
        finally:
            player.cancel()
            await conv.close()

    run(main())


def audio_runs(pushed: list[tuple[str, float | None, tuple[int, ...]]]) -> list[tuple[float, float]]:
    """The audio pushes as (start, end) on the media clock, back-to-back pushes joined."""
    runs: list[tuple[float, float]] = []
    for kind, at, shape in pushed:
        if kind == "audio":
            assert at is not None
            end = at + shape[0] / 16000
            if runs and at == pytest.approx(runs[-1][1]):
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((at, end))
    return runs


def test_video_frames_and_audio_reach_the_engine_in_order_at_their_media_clock_times() -> None:
    async def main() -> None:
        conv, script, events, player = await started()
        image = np.zeros((64, 96, 3), np.uint8)
        try:
            conv.see(image)  # t = 0
            conv.see(image)  # no audio since: nothing new in time, dropped
            await feed(conv, script, 0.1, 10)
            conv.see(image)  # 0.32 s, before the pre-roll audio (from 0.224 s) goes in: the order they came in
            await feed(conv, script, 0.9, 5)  # speech from chunk 10: 3 chunks of pre-roll go with it
            conv.see(image)  # 0.48 s, in the middle of the turn's audio
            await feed(conv, script, 0.9, 5)
            await feed(conv, script, 0.1, 12)  # the turn ends after 10 chunks of silence (0.96 s); the answer is
            # prepared after 5 (0.8 s), and the silence after that stays out of the turn
            await until(events, "response.created")
            while conv.state != State.SPEAKING:
                await asyncio.sleep(0.01)
            conv.see(image)  # 1.024 s, during the answer: queued, goes in after it
            await feed(conv, script, 0.1, 2)
            await feed(conv, script, 0.9, 8)  # a barge-in from chunk 34, with its pre-roll from chunk 31
            await feed(conv, script, 0.1, 12)
            await until(events, "response.done")
            while len([e for e in events if e["type"] == "response.done"]) < 2:
                await asyncio.sleep(0.02)

            pushed = conv.session.pushed
            assert [at for at, _ in conv.session.images] == pytest.approx([0.0, 0.32, 0.48, 1.024])
            assert {shape for _, shape in conv.session.images} == {(64, 96, 3)}
            runs = audio_runs(pushed)
            assert runs == [pytest.approx((0.224, 0.8)), pytest.approx((0.992, 1.504))]
            order = [(kind, at) for kind, at, _ in pushed]
            middle = order.index(("image", pytest.approx(0.48)))
            assert order[middle - 1][0] == order[middle + 1][0] == "audio"
            before, after = pushed[middle - 1], pushed[middle + 1]
            assert before[1] + before[2][0] / 16000 == pytest.approx(0.48) == after[1]
            assert order.index(("image", pytest.approx(1.024))) < order.index(("audio", pytest.approx(0.992)))
            stats = conv.session.video_stats()
            assert stats["frames_received"] == 4 and stats["last_at"] == pytest.approx(1.024)
            assert not [e for e in events if e["type"] == "error"]
        finally:
            player.cancel()
            await conv.close()

    run(main())


def test_a_frame_the_engine_refuses_is_one_error_event_and_the_call_goes_on() -> None:
    async def main() -> None:
        conv, script, events, player = await started()
        try:
            for _ in range(3):
                conv.see(np.zeros((48, 64), np.uint8))  # not RGB
                await feed(conv, script, 0.1, 2)
            error = await until(events, "error")
            assert error["error"]["code"] == "invalid_image"
            conv.see(np.zeros((64, 64, 3), np.uint8))
            await feed(conv, script, 0.9, 10)
            await feed(conv, script, 0.1, 12)
            assert (await until(events, "response.done"))["response"]["status"] == "incomplete"
            assert len([e for e in events if e["type"] == "error"]) == 1
            assert conv.session.video_stats()["frames_received"] == 1
        finally:
            player.cancel()
            await conv.close()

    run(main())


def test_a_cut_answer_reports_its_whole_calls_and_never_a_cut_one() -> None:
    """An answer of calls cut at its first piece of arguments, or just after its first whole call: response.done
    lists exactly the calls that are whole (they are in the engine's history), each with its `.done` and all its
    argument deltas, valid against its schema; a call cut before its end gets no `.done` and takes no output. The
    outputs of the whole calls go back, once each; the next answer is spoken. Four seeds."""
    tools = tuple(Tool.function(t["name"], t["description"], t["parameters"]) for t in TOOLS)

    async def main() -> None:
        for seed in range(4):
            cut_at = "response.function_call_arguments.delta" if seed % 2 else "response.function_call_arguments.done"
            conv, _, events, player = await started(options=SessionOptions(seed=seed, max_frames=6),
                                                    answer_tokens=CALL_TOKENS)
            try:
                conv.update(None, None, None, tools=ToolSet(tools, "required"))
                conv.add_text("Turn up the heating in the back and add milk to my list.")
                conv.create_response()
                await until(events, cut_at)
                if conv.answering:  # (it may have been made already: then nothing is cut)
                    conv.cancel_response()
                done = (await until(events, "response.done"))["response"]
                calls = {c["call_id"]: c for c in done["function_calls"]}
                if cut_at.endswith("done"):
                    assert calls
                deltas: dict[str, str] = {}
                for e in events:
                    if e["type"] == "response.function_call_arguments.delta":
                        deltas[e["call_id"]] = deltas.get(e["call_id"], "") + e["delta"]
                finished = [(e["call_id"], e["name"], e["arguments"]) for e in events
                            if e["type"] == "response.function_call_arguments.done"]
                assert finished == [(c["call_id"], c["name"], c["arguments"]) for c in calls.values()]
                for c in calls.values():
                    valid_call(c["name"], c["arguments"])
                    assert deltas[c["call_id"]] == c["arguments"]
                for call_id in set(deltas) - set(calls):  # cut while it was being written
                    with pytest.raises(ConversationError):
                        conv.add_tool_output(call_id, "{}")

                conv.update(None, None, None, tools=ToolSet(tools, "none"))
                for call_id in calls:
                    conv.add_tool_output(call_id, '{"ok": true}')
                    with pytest.raises(ConversationError):
                        conv.add_tool_output(call_id, '{"ok": true}')  # one output per call
                if not calls:
                    conv.add_text("Never mind.")
                events.clear()
                conv.create_response()
                spoken = (await until(events, "response.done"))["response"]
                assert spoken["status"] == "incomplete" and spoken["metrics"]["frames_sent"] > 0
                assert not spoken["function_calls"] and not [e for e in events if "function_call" in e["type"]]
            finally:
                player.cancel()
                await conv.close()

    run(main(), timeout_s=200)
