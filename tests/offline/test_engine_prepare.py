"""An answer made ready at a pause in the caller's turn (`Session.prepare_answer`, what the call server does during
its hang-over, its first frame of speech included): the same answer as the turn gives without it, undone exactly
when the caller goes on, and nothing left behind when the call ends instead. Seeded sampling, so that a random
state not put back would show."""
from __future__ import annotations

import asyncio

import numpy as np
from engine_helpers import caller_audio, engine_for, one_turn, run

from rtc_agent.engine import SessionOptions
from rtc_agent.engine.step.talker import TalkerRow

OPTIONS = SessionOptions(seed=7, max_answer_tokens=6, max_frames=8)


def _answer(result) -> tuple[list[int], list[tuple[int, ...]], list[bytes]]:
    texts, frames, done = result
    return list(done.token_ids), [f.codes for f in frames], [f.samples.tobytes() for f in frames]


async def _turns(session, pieces: list[np.ndarray | str]) -> list:
    """Push each piece of audio; "flush" and "prepare" at the pauses; "respond" ends a turn. The answers."""
    answers = []
    for piece in pieces:
        if isinstance(piece, np.ndarray):
            for start in range(0, len(piece), 320):
                await session.push_audio(piece[start:start + 320])
        elif piece == "flush":
            await session.flush()
        elif piece == "prepare":
            await session.prepare_answer()
        else:
            answers.append(await one_turn(session, piece[:0]))
    return answers


def _run_turns(pieces: list, first_frame: bool | None = True) -> list:
    """`first_frame`: EngineOptions.first_frame_in_preparation (None: the default, which on the CPU is off)."""
    session = engine_for(prefill_chunk_s=1.0, first_frame_in_preparation=first_frame).new_session(OPTIONS)
    try:
        return run(_turns(session, pieces))
    finally:
        run(session.close())


def test_a_prepared_answer_is_the_answer_the_turn_gives_at_its_end():
    said, next_turn = caller_audio(1.7, seed=4), caller_audio(1.2, seed=5)
    prepared = _run_turns([said, "prepare", "respond", next_turn, "prepare", "respond"])
    at_the_end = _run_turns([said, "respond", next_turn, "respond"])
    assert [_answer(a) for a in prepared] == [_answer(a) for a in at_the_end]
    for _, frames, done in prepared:
        assert frames and done.metrics["ready_before_ms"] >= 0 and done.metrics["ttft_ms"] <= done.metrics["ttfp_ms"]
        assert done.metrics["frames_ready"] == 1  # its first frame was made before the turn's end
    without_frame = _run_turns([said, "prepare", "respond"], first_frame=False)  # (the CPU's default)
    assert [_answer(a) for a in without_frame] == [_answer(a) for a in at_the_end[:1]]
    metrics = without_frame[0][2].metrics
    assert metrics["frames_ready"] == 0 and metrics["ttft_ms"] < metrics["ttfp_ms"]  # (its first frame came after)


def test_speech_after_the_pause_undoes_the_prepared_answer_exactly():
    before, after, next_turn = caller_audio(1.3, seed=6), caller_audio(0.9, seed=8), caller_audio(1.1, seed=9)
    went_on = _run_turns([before, "prepare", after, "respond", next_turn, "respond"])
    never_paused = _run_turns([before, after, "respond", next_turn, "respond"])
    assert [_answer(a) for a in went_on] == [_answer(a) for a in never_paused]
    assert "ready_before_ms" not in went_on[0][2].metrics


def test_a_short_turn_is_flushed_then_prepared_and_undone_to_the_flushed_turn():
    short, after = caller_audio(0.6, seed=10), caller_audio(0.7, seed=11)  # shorter than a prefill chunk
    assert [_answer(a) for a in _run_turns([short, "prepare", "respond"])] == \
        [_answer(a) for a in _run_turns([short, "flush", "respond"])]
    assert [_answer(a) for a in _run_turns([short, "prepare", after, "respond"])] == \
        [_answer(a) for a in _run_turns([short, "flush", after, "respond"])]


def test_a_call_that_ends_with_an_answer_prepared_gives_its_slot_back():
    engine = engine_for(prefill_chunk_s=1.0)
    free = engine.pool.free
    session = engine.new_session(OPTIONS)
    run(_turns(session, [caller_audio(1.2, seed=3), "prepare"]))
    assert engine.pool.free == free - 1
    run(session.close())
    assert engine.pool.free == free


def test_the_turns_end_and_the_answers_prefix_are_one_talker_prefill(monkeypatch):
    """The last piece of the caller's turn and the answer's assistant prefix go to the Talker as one prefill (a
    turn end then costs the worker one round fewer); the answers are those of two prefills, prepared or not."""
    said, next_turn = caller_audio(1.3, seed=4), caller_audio(1.2, seed=5)
    joins = []
    joins_alone = TalkerRow._joins

    def recorded(self, *args):
        joins.append(joins_alone(self, *args))
        return joins[-1]

    monkeypatch.setattr(TalkerRow, "_joins", recorded)
    joined = _run_turns([said, "prepare", "respond", next_turn, "respond"])
    assert joins == [True, True]
    monkeypatch.setattr(TalkerRow, "_joins", lambda self, *args: False)
    apart = _run_turns([said, "prepare", "respond", next_turn, "respond"])
    assert [_answer(a) for a in joined] == [_answer(a) for a in apart]



def test_without_a_side_stream_each_frame_goes_out_before_the_next_token_is_made(monkeypatch):
    """On the CPU (no side stream for the Thinker) a step sends its frames before it makes the Thinker's next
    token, which is for the frame after: the first frame at a turn's end comes that much sooner, and every frame
    one step after the one before. The answers are the same (the tests above compare them with stock's)."""
    from rtc_agent.engine.step import answer as answer_module

    order: list[str] = []
    send_frames, start_tokens = answer_module._send_frames, answer_module._start_tokens
    monkeypatch.setattr(answer_module, "_send_frames",
                        lambda pool, going: (order.append(f"frame {going[0].frames}"), send_frames(pool, going))[1])
    monkeypatch.setattr(answer_module, "_start_tokens", lambda pool, answers, overlap: (
        order.append(f"token after {answers[0].frames}"), start_tokens(pool, answers, overlap))[1])
    _run_turns([caller_audio(1.7, seed=4), "respond"], first_frame=None)
    assert order[:6] == ["frame 0", "token after 0", "frame 1", "token after 1", "frame 2", "token after 2"], order


def test_a_preparation_ends_with_the_first_frame_and_the_answers_first_step_makes_the_token_after_it(monkeypatch):
    """The round's last stage makes the prepared answers' first frames only: the Thinker token and the Talker step
    for their second frames, which every answer of the stage would wait for before its first frame could go out,
    come with the answer's first step. The answer is the same (the first test of this file)."""
    from rtc_agent.engine.step import answer as answer_module

    order: list[str] = []
    start_tokens = answer_module._start_tokens
    monkeypatch.setattr(answer_module, "_start_tokens", lambda pool, answers, overlap: (
        order.append(f"token after {answers[0].frames}"), start_tokens(pool, answers, overlap))[1])

    async def turn(session) -> None:
        await _turns(session, [caller_audio(1.7, seed=4), "prepare"])
        order.append("prepared")
        await one_turn(session, np.zeros(0, np.float32))

    session = engine_for(prefill_chunk_s=1.0, first_frame_in_preparation=True).new_session(OPTIONS)
    try:
        run(turn(session))
    finally:
        run(session.close())
    assert order[:2] == ["prepared", "token after 1"], order  # (before: "token after 0", "prepared")


def test_pushes_sent_without_waiting_for_each_other_keep_their_order_from_a_calls_first_input() -> None:
    """The media side sends a call's pushes without waiting for the replies: on a new session they all wait for
    the one context the first makes, then go in the order they were sent."""
    async def main() -> np.ndarray:
        session = engine_for(prefill_chunk_s=1.0).new_session(OPTIONS)
        try:
            pieces = [np.full(1600, n / 10, np.float32) for n in (1, 2, 3)]
            await asyncio.gather(*(session.push_audio(piece) for piece in pieces))
            return session.context.pending
        finally:
            await session.close()

    pending = run(main())
    assert np.array_equal(pending, np.repeat(np.float32([0.1, 0.2, 0.3]), 1600))
