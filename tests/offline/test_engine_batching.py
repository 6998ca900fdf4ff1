"""Several sessions at once: each answer is the same batched as alone (greedy, tiny model on the CPU), slots are
reused, and a full engine refuses a session cleanly."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from engine_helpers import caller_audio, engine_for, greedy, one_turn, run

from rtc_agent.engine import Engine, EngineFullError
from rtc_agent.engine.options import EngineOptions, SessionOptions
from rtc_agent.engine.scheduler.policy import AudioRequest, PrefillRequest, TalkerPrefillRequest, TokenRequest
from rtc_agent.engine.step import graphs

TOKENS, FRAMES = 6, 10


def _answer(result) -> tuple[list[int], list[tuple[int, ...]]]:
    texts, frames, done = result
    return list(done.token_ids), [f.codes for f in frames]


def _decoded_exactly(engine, frames: list) -> None:
    """An answer's streamed audio is its codes' one-shot Code2Wav decode: frame k carries the decode's samples
    [k x 1920 - lag, (k + 1) x 1920 - lag), as the streaming decoder promises (code2wav.py)."""
    codes = torch.tensor([f.codes for f in frames]).T[None]  # [1, 16, frames]
    with torch.inference_mode():
        one_shot = engine.model.code2wav(codes)[0, 0].numpy()
    streamed = np.concatenate([f.samples for f in frames])
    lag = engine.pool.code2wav.rows[0].lag
    np.testing.assert_allclose(streamed[lag:], one_shot[:len(streamed) - lag], rtol=0, atol=1e-5)


def _recording_steps(engine) -> tuple[list[int], object]:
    """Record how many answers each step of the engine's worker advances; returns the list and the step to put
    back."""
    sizes: list[int] = []
    step = engine._worker._step

    def recording(answers):
        sizes.append(len(answers))
        step(answers)

    engine._worker._step = recording
    return sizes, step


def _recording_rounds(engine) -> tuple[list[tuple[int, ...]], object]:
    """Record each stage of the worker's rounds as (audio stretches, Thinker prefills, first tokens, Talker
    prefills); returns the list and the function to put back."""
    rounds: list[tuple[int, ...]] = []
    run_requests = engine._worker._run_requests

    def recording(requests):
        rounds.append(tuple(sum(isinstance(r, kind) for r in requests)
                            for kind in (AudioRequest, PrefillRequest, TokenRequest, TalkerPrefillRequest)))
        return run_requests(requests)

    engine._worker._run_requests = recording
    return rounds, run_requests


def test_answers_are_the_same_batched_as_alone():
    engine = engine_for(prefill_chunk_s=0)
    audios = [caller_audio(2.0, seed=1), caller_audio(1.3, seed=2), caller_audio(2.6, seed=3)]  # other lengths
    alone = []
    for audio in audios:
        session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
        alone.append(run(one_turn(session, audio)))
        run(session.close())
    sizes, step = _recording_steps(engine)
    try:
        sessions = [engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES)) for _ in audios]

        async def together():  # every caller's turn in first, then all answers at once
            for session, audio in zip(sessions, audios):
                await session.push_audio(audio)
            return await asyncio.gather(*(one_turn(s, a[:0]) for s, a in zip(sessions, audios)))

        batched = run(together())
        for session in sessions:
            run(session.close())
    finally:
        engine._worker._step = step
    assert max(sizes) >= 2  # answers really were stepped together
    assert [_answer(r) for r in batched] == [_answer(r) for r in alone]
    for result in batched:  # their first frames' Code2Wav steps, taken together, too
        _decoded_exactly(engine, result[1])


def test_a_caller_joining_mid_answer_changes_nothing_for_the_others():
    engine = engine_for(prefill_chunk_s=0)
    first_audio, second_audio = caller_audio(2.0, seed=4), caller_audio(1.5, seed=5)
    reference = []
    for audio in (first_audio, second_audio):
        session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
        reference.append(run(one_turn(session, audio)))
        run(session.close())

    async def joined():
        first = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
        second = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
        for start in range(0, len(first_audio), 320):
            await first.push_audio(first_audio[start:start + 320])
        frames, results = [], []

        async def listen():
            async for event in first.respond():
                frames.append(event)
                if len(frames) == 3:  # the second caller talks while the first one's answer streams
                    results.append(await one_turn(second, second_audio))

        await listen()
        await first.close()
        await second.close()
        return frames, results[0]

    frames, second_result = run(joined())
    done = frames[-1]
    speech = [f for f in frames if hasattr(f, "codes")]
    assert (list(done.token_ids), [f.codes for f in speech]) == _answer(reference[0])
    assert _answer(second_result) == _answer(reference[1])
    # the second answer's first frames (fewer frames before them) next to the first one's steady frames
    _decoded_exactly(engine, speech)
    _decoded_exactly(engine, second_result[1])


def test_a_full_engine_refuses_a_session_and_a_closed_one_frees_its_slot():
    engine = engine_for(prefill_chunk_s=0)
    sessions = []
    with pytest.raises(EngineFullError):
        for _ in range(len(engine.pool) + 1):
            sessions.append(engine.new_session(greedy()))
    assert len(sessions) == len(engine.pool) and engine.pool.free == 0
    run(sessions[0].close())
    again = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))  # the freed slot, reset
    texts, frames, done = run(one_turn(again, caller_audio(1.0)))
    assert frames and done.frames == len(frames)
    for session in [again, *sessions[1:]]:
        run(session.close())
    assert engine.pool.free == len(engine.pool)


@pytest.mark.parametrize("key_bounds, chosen, sampled, written", [
    (graphs.KEY_BOUNDS, {graphs.KEY_BOUNDS[0]}, False, False),
    ((24, 48, 96), {48, 96, None}, False, False),
    (graphs.KEY_BOUNDS, {graphs.KEY_BOUNDS[0]}, True, False),
    (graphs.KEY_BOUNDS, {graphs.KEY_BOUNDS[0]}, True, True)])
def test_prefills_of_callers_talking_at_once_are_batched_and_change_nothing(monkeypatch, key_bounds, chosen,
                                                                            sampled, written):
    """Three callers whose audio chunks and turn ends reach the worker at the same moment: their audio is encoded
    in one pass and their Thinker and Talker prefills run as batched steps (rows at different cache lengths), their
    first tokens and first codes 0 are drawn together, and each answer equals the one made alone (greedy, or
    `sampled` with each session's own seed; `written`: the second caller's answers are text only, so only the
    others' first tokens get the Talker's text input). The batched steps attend over the fewest keys that hold
    their rows' new positions (`graphs.KEY_BOUNDS`); with small bounds, the contexts outgrow them during the turns."""
    monkeypatch.setattr(graphs, "KEY_BOUNDS", key_bounds)
    engine = engine_for(prefill_chunk_s=0.5)
    bounds: list[int | None] = []  # the key bound of each batched prefill (Thinker and Talker)
    for batched_prefill in (engine.pool._batched_prefill, engine.pool.talker._batched_prefill):
        bounded = batched_prefill._bounded

        def recording(embeds, view, bound, bounded=bounded):
            bounds.append(bound)
            return bounded(embeds, view, bound)

        monkeypatch.setattr(batched_prefill, "_bounded", recording)
    audios = [caller_audio(1.7, seed=6), caller_audio(1.1, seed=7), caller_audio(2.3, seed=8)]

    def options(caller: int) -> SessionOptions:
        speech = not (written and caller == 1)
        if sampled:
            return SessionOptions(seed=caller, max_answer_tokens=TOKENS, max_frames=FRAMES, speech=speech)
        return greedy(max_answer_tokens=TOKENS, max_frames=FRAMES, speech=speech)

    alone = []
    for caller, audio in enumerate(audios):
        session = engine.new_session(options(caller))
        alone.append(_answer(run(one_turn(session, audio))))
        run(session.close())
    worker = engine._worker
    rounds, run_requests = _recording_rounds(engine)
    sessions = [engine.new_session(options(caller)) for caller in range(len(audios))]
    try:
        async def together():
            for session in sessions:  # (each call's first job makes its context: out of the way first)
                await session._ready_context()
            with worker.held():  # every caller's audio queues up before any of it starts
                pushed = [asyncio.ensure_future(s.push_audio(a)) for s, a in zip(sessions, audios)]
                await asyncio.sleep(0)
            await asyncio.gather(*pushed)
            return await asyncio.gather(*(one_turn(s, a[:0]) for s, a in zip(sessions, audios)))

        batched = [_answer(result) for result in run(together())]
    finally:
        worker._run_requests = run_requests
        for session in sessions:
            run(session.close())
    callers = len(audios)  # all three's chunks at once, in each stage; their first tokens; their Talker prefixes
    assert {(callers, 0, 0, 0), (0, callers, 0, 0), (0, 0, callers, 0), (0, 0, 0, callers)} <= set(rounds), rounds
    assert rounds.count((0, 0, 0, callers)) >= 2, rounds
    assert batched == alone
    assert set(bounds) == chosen, bounds


def test_a_new_call_starts_from_the_kept_system_prompt():
    """The first call with a system prompt prefills it and the pool keeps its keys and values; the next call, on
    another slot, starts from that copy and answers as the first did."""
    engine = engine_for(prefill_chunk_s=0)
    engine.pool._prompts.clear()
    audio = caller_audio(1.2, seed=12)
    first = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    second = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    try:
        prefilled = _answer(run(one_turn(first, audio)))
        assert len(engine.pool._prompts) == 1
        with torch.inference_mode():  # nothing left in its slot from earlier calls
            for buffer in (*second._slot.cache.keys, *second._slot.cache.values):
                buffer.zero_()
        copied = _answer(run(one_turn(second, audio)))
        assert first._slot.index != second._slot.index
        assert copied == prefilled
        other = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES, instructions="Be brief."))
        run(one_turn(other, audio))
        assert len(engine.pool._prompts) == 2  # another prompt: prefilled, and kept too
        run(other.close())
    finally:
        run(first.close())
        run(second.close())


def test_the_warm_up_ends_turns_at_every_captured_width_in_one_round():
    """The warm-up's turns: one, then 2, 4 ... every slot at once, each stage of their answers' preparation one
    round for all (a server's first burst of callers meets no width for the first time); every slot is free
    after it."""
    engine = Engine.load(EngineOptions(max_sessions=5))
    try:
        rounds, _ = _recording_rounds(engine)
        run(engine.warmup())
        assert engine.ready
        for width in (1, 2, 4, 5):  # graphs.batch_sizes(5)
            assert {(width, 0, 0, 0), (0, width, 0, 0), (0, 0, width, 0), (0, 0, 0, width)} <= set(rounds), rounds
        assert not {stage for stage in rounds if 3 in stage}, rounds
        assert engine.pool.free == 5
    finally:
        engine.close()
