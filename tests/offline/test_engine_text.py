"""A typed turn (`Session.push_text`) on the tiny model: the streamed answer equals stock `generate` given the
same chat as text, and typed text after speech joins that turn after its audio block."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import caller_audio, engine_for, greedy, recording_stock_codes, run
from rtc_agent.engine import ResponseDone, SpeechFrame, TextDelta

TOKENS, FRAMES = 8, 12
QUESTION = "What is the capital of France?"


async def typed_turn(session, text: str):
    await session.push_text(text)
    texts, frames, done = [], [], None
    async for event in session.respond():
        if isinstance(event, TextDelta):
            texts.append(event.token_id)
        elif isinstance(event, SpeechFrame):
            frames.append(event.codes)
        elif isinstance(event, ResponseDone):
            done = event
    return texts, frames, done


def test_typed_turn_equals_stock_generate_on_the_same_text():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    texts, frames, done = run(typed_turn(session, QUESTION))

    ids, tok = engine.ids, engine.tokenizer
    prompt = [ids.im_start, ids.system, ids.newline,
              *tok.encode(session.options.instructions, add_special_tokens=False), ids.im_end, ids.newline,
              ids.im_start, ids.user, ids.newline, *tok.encode(QUESTION, add_special_tokens=False), ids.im_end,
              ids.newline, ids.im_start, ids.assistant, ids.newline]
    input_ids = torch.tensor([prompt])
    with recording_stock_codes(engine.model) as recorded:
        sequences, _ = engine.model.generate(input_ids=input_ids, speaker="ethan", return_audio=True,
                                             thinker_max_new_tokens=TOKENS, thinker_do_sample=False,
                                             talker_do_sample=False, talker_max_new_tokens=FRAMES + 1)
    stock_ids = sequences[0, input_ids.shape[1]:].tolist()
    assert texts and texts == stock_ids[:len(texts)]
    assert list(done.token_ids) == [t for t in stock_ids if t != ids.im_end]
    assert torch.equal(torch.tensor(frames).T, recorded["codes"][0])  # all 16 codebooks, frame for frame
    conv = session.context
    assert conv.segments[1].ids == prompt[len(conv.segments[0].ids):-3]  # the user turn as the chat template has it


def test_typed_text_after_speech_joins_the_turn_after_its_audio():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=4, max_frames=4))

    async def main():
        await session.push_audio(caller_audio(1.0))
        return await typed_turn(session, "And in words?")

    _, _, done = run(main())
    ids = engine.ids
    user = session.context.segments[1].ids
    typed = engine.tokenizer.encode("And in words?", add_special_tokens=False)
    end = user.index(ids.audio_end)
    assert user[end + 1:] == [*typed, ids.im_end, ids.newline] and ids.audio in user[:end]
    assert done.frames > 0


@pytest.mark.parametrize("text", ["", 7])
def test_bad_text_is_refused_and_changes_nothing(text):
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=4, max_frames=4))
    with pytest.raises(ValueError):
        run(session.push_text(text))
    with pytest.raises(ValueError, match="no caller audio"):
        run(_respond(session))


async def _respond(session):
    async for _ in session.respond():
        pass
