"""The engine's behaviour on the tiny model: turns, barge-in, modes, voices, limits and bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
from engine_helpers import caller_audio, engine_for, greedy, one_turn, run
from test_engine_equivalence import stock_generate

from rtc_agent.engine import Engine, EngineOptions, ModelLoadError, SessionOptions, SpeechFrame, TurnTooLongError
from rtc_agent.engine.model.loader import load
from rtc_agent.engine.model.tiny import tiny_checkpoint_dir


def test_second_turn_sees_the_first_and_matches_stock():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=6, max_frames=8))
    first, second = caller_audio(1.2, seed=1), caller_audio(1.0, seed=2)

    async def two_turns():
        a = await one_turn(session, first)
        b = await one_turn(session, second)
        return a, b

    (_, frames1, done1), (texts2, frames2, done2) = run(two_turns())
    assert len(frames1) == len(frames2) == 8
    stock_ids, stock_codes, _ = stock_generate(engine, session.options.instructions,
                                               [(first, list(done1.token_ids)), (second, None)])
    assert list(done2.token_ids) == stock_ids[:6]
    assert [t.token_id for t in texts2] == list(done2.token_ids)


def test_context_budget_drops_old_turns_instead_of_failing():
    engine = engine_for(prefill_chunk_s=1.0, context_tokens=512, max_answer_tokens=16, max_frames=16)
    session = engine.new_session(greedy(max_answer_tokens=8, max_frames=4))

    async def many_turns():
        lengths = []
        for turn in range(8):
            await one_turn(session, caller_audio(4.0, seed=turn))
            lengths.append(session.context.cache.length)
        return lengths, [s.role for s in session.context.segments]

    lengths, roles = run(many_turns())
    assert max(lengths) <= 512
    assert roles[0] == "system" and roles.count("user") < 8  # the oldest turns were dropped


def test_turn_longer_than_the_budget_is_refused_and_the_session_goes_on():
    engine = engine_for(prefill_chunk_s=1.0, context_tokens=512, max_answer_tokens=16, max_frames=16)
    session = engine.new_session(greedy(max_answer_tokens=4, max_frames=4))

    async def too_long_then_normal():
        with pytest.raises(TurnTooLongError, match="context budget"):
            await session.push_audio(caller_audio(60.0))
        return await one_turn(session, caller_audio(1.0))

    _, frames, done = run(too_long_then_normal())
    assert len(frames) == 4 and len(done.token_ids) == 4


def test_barge_in_stops_within_a_frame_and_keeps_only_the_heard_text():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=20, max_frames=30))

    async def interrupted_then_next():
        texts, frames, done = await one_turn(session, caller_audio(1.0), cancel_after=5, frames_played=3)
        history = [s.ids for s in session.context.segments if s.role == "assistant"]
        after = await one_turn(session, caller_audio(1.0, seed=9))
        return texts, frames, done, history, after

    texts, frames, done, history, after = run(interrupted_then_next())
    assert done.interrupted and len(frames) == 5  # cancel lands after frame 5: nothing more is made
    assert list(done.token_ids) == [t.token_id for t in texts[:3]]
    ids = engine.ids
    assert history[-1] == [ids.im_start, ids.assistant, ids.newline, *done.token_ids, ids.im_end, ids.newline]
    assert not after[2].interrupted and after[2].frames == 30


def test_barge_in_after_the_answer_was_made_trims_the_history():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=12, max_frames=12))

    async def answer_then_late_cancel():
        _, frames, done = await one_turn(session, caller_audio(1.0))
        await session.cancel(frames_played=4)  # the caller spoke while frame 5 was playing
        return done, session.context.segments[-1].ids, session.context.cache.length

    done, history, length = run(answer_then_late_cancel())
    ids = engine.ids
    assert history == [ids.im_start, ids.assistant, ids.newline, *done.token_ids[:4], ids.im_end, ids.newline]
    assert length == sum(len(s.ids) for s in session.context.segments)


def test_speech_cut_by_its_length_limit_ends_the_text_too():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=20, max_frames=5))
    texts, frames, done = run(one_turn(session, caller_audio(1.0)))
    assert len(frames) == 5 and len(texts) == 5 and not done.interrupted


def test_text_only_engine_loads_no_talker_and_streams_text():
    engine = engine_for(text_only=True)
    speech = engine_for(prefill_chunk_s=0)
    assert not hasattr(engine.model, "talker") and not hasattr(engine.model, "code2wav")
    params = sum(p.numel() for p in engine.model.parameters())
    assert params < sum(p.numel() for p in speech.model.parameters())
    texts, frames, done = run(one_turn(engine.new_session(greedy(max_answer_tokens=7)), caller_audio(1.0)))
    assert frames == [] and len(texts) == 7 and done.frames == 0


def test_non_streaming_gives_the_same_answer_text_first():
    streaming = engine_for(prefill_chunk_s=0)
    whole = engine_for(prefill_chunk_s=0, streaming=False)
    audio = caller_audio(1.0)
    _, frames_a, done_a = run(one_turn(streaming.new_session(greedy(max_answer_tokens=5, max_frames=8)), audio))

    async def collect():
        session = whole.new_session(greedy(max_answer_tokens=5, max_frames=8))
        await session.push_audio(audio)
        return [event async for event in session.respond()]

    events = run(collect())
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["TextDelta"] * 5 + ["SpeechFrame"] * 8 + ["ResponseDone"]
    assert events[-1].token_ids == done_a.token_ids
    assert [e.codes for e in events if isinstance(e, SpeechFrame)] == [f.codes for f in frames_a]
    whole_audio = np.concatenate([e.samples for e in events if isinstance(e, SpeechFrame)])
    # the same audio: the same codes (above) decoded by the same Code2Wav; float32 sums on the CPU may round in
    # another order from one run to the next (seen once in CI: 1 ulp), so equal within 1e-5
    np.testing.assert_allclose(whole_audio, np.concatenate([f.samples for f in frames_a]), rtol=0, atol=1e-5)


def test_voices_change_the_speech_not_the_text():
    engine = engine_for(prefill_chunk_s=0)
    audio = caller_audio(1.0)
    answers = {voice: run(one_turn(engine.new_session(greedy(voice=voice, max_answer_tokens=4, max_frames=6)), audio))
               for voice in ("chelsie", "ethan", "aiden")}
    assert len({a[2].token_ids for a in answers.values()}) == 1
    assert len({tuple(f.codes for f in a[1]) for a in answers.values()}) == 3
    with pytest.raises(ValueError, match="unknown voice"):
        SessionOptions(voice="bob")


def test_seeded_sampling_repeats_and_differs_across_seeds():
    engine = engine_for(prefill_chunk_s=0)
    audio = caller_audio(1.0)

    def answer(seed):
        return run(one_turn(engine.new_session(SessionOptions(seed=seed, max_answer_tokens=6, max_frames=4)), audio))[2]

    assert answer(1).token_ids == answer(1).token_ids
    assert answer(1).token_ids != answer(2).token_ids


@pytest.mark.parametrize("bad, message", [
    (np.zeros(0, np.float32), "no caller audio"),
    (np.full(1600, np.nan, np.float32), "NaN"),
    (np.zeros((2, 1600), np.float32), "mono"),
    (np.zeros(1600, np.int16), "float"),
])
def test_bad_audio_is_refused_with_a_clear_error(bad, message):
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))

    async def attempt():
        await session.push_audio(bad)
        async for _ in session.respond():
            pass

    with pytest.raises(ValueError, match=message):
        run(attempt())
    _, frames, _ = run(one_turn(session, caller_audio(0.5)))  # the session is still usable
    assert len(frames) == 2


def test_wrong_sample_rate_is_refused():
    session = engine_for(prefill_chunk_s=0).new_session()
    with pytest.raises(ValueError, match="16000 Hz"):
        run(session.push_audio(np.zeros(480, np.float32), sample_rate=48000))


def test_a_saved_checkpoint_loads_from_its_path(tmp_path):
    loaded = load(str(tiny_checkpoint_dir()), device="cpu", dtype="float32")
    assert loaded.model.config.model_type == "qwen3_omni_moe"
    texts, frames, _ = run(one_turn(Engine(loaded, EngineOptions(prefill_chunk_s=0)).new_session(
        greedy(max_answer_tokens=3, max_frames=3)), caller_audio(0.5)))
    assert len(texts) == 3 and len(frames) == 3


def test_model_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="not Qwen3-Omni"):
        load(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no usable CUDA"):
        load("tiny", device="cuda")


def test_a_session_can_answer_in_text_on_an_engine_that_speaks_and_speak_again():
    engine = engine_for(prefill_chunk_s=0)
    audio = caller_audio(1.0)
    _, _, spoken = run(one_turn(engine.new_session(greedy(max_answer_tokens=6, max_frames=8)), audio))

    async def text_then_speech():
        session = engine.new_session(greedy(max_answer_tokens=6, max_frames=8, speech=False))
        written = await one_turn(session, audio)
        session.update(speech=True)
        again = await one_turn(session, caller_audio(1.0, seed=1))
        await session.close()
        return written, again

    (texts, frames, written), (_, frames_again, _) = run(text_then_speech())
    assert frames == [] and written.frames == 0 and len(texts) == 6
    assert written.token_ids == spoken.token_ids  # the Thinker's text does not depend on the Talker
    assert len(frames_again) > 0
