"""The streaming engine against stock transformers on the tiny model, under greedy decoding."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import caller_audio, engine_for, greedy, one_turn, recording_stock_codes, run

from rtc_agent.engine.step import audio_input
from rtc_agent.engine.step.code2wav import Code2WavRows, StreamingCode2Wav

TOKENS, FRAMES = 10, 24  # the talker runs on after the text ends (tts_eos, then tts_pad)


def stock_generate(engine, instructions: str, turns: list[tuple[np.ndarray, list[int] | None]], voice: str = "ethan"):
    """Stock `generate(return_audio=True)` on the same conversation; returns (text ids, codes [16, T], wav)."""
    model, tok, ids = engine.model, engine.tokenizer, engine.ids
    prompt = [ids.im_start, ids.system, ids.newline, *tok.encode(instructions, add_special_tokens=False),
              ids.im_end, ids.newline]
    features = []
    for audio, answer in turns:
        mel = audio_input.log_mel(engine.feature_extractor, audio)
        features.append(mel)
        prompt += [ids.im_start, ids.user, ids.newline, ids.audio_start]
        prompt += [ids.audio] * audio_input.token_count(mel.shape[1])
        prompt += [ids.audio_end, ids.im_end, ids.newline, ids.im_start, ids.assistant, ids.newline]
        if answer is not None:
            prompt += answer + [ids.im_end, ids.newline]
    longest = max(f.shape[1] for f in features)
    padded = torch.zeros(len(features), features[0].shape[0], longest)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, f in enumerate(features):
        padded[row, :, :f.shape[1]] = f
        mask[row, :f.shape[1]] = 1
    with recording_stock_codes(model) as recorded:
        input_ids = torch.tensor([prompt])
        sequences, wav = model.generate(
            input_ids=input_ids, input_features=padded, feature_attention_mask=mask, speaker=voice, return_audio=True,
            thinker_max_new_tokens=TOKENS, thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=FRAMES + 1)
    return sequences[0, input_ids.shape[1]:].tolist(), recorded["codes"][0], wav.reshape(-1)


def test_streamed_answer_equals_stock_generate():
    engine = engine_for(prefill_chunk_s=0)
    audio = caller_audio(2.0)
    session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    texts, frames, done = run(one_turn(session, audio))
    stock_ids, stock_codes, stock_wav = stock_generate(engine, session.options.instructions, [(audio, None)])

    assert [t.token_id for t in texts] == stock_ids[:len(texts)]
    assert list(done.token_ids) == [t for t in stock_ids if t != engine.ids.im_end]
    codes = torch.tensor([f.codes for f in frames]).T
    assert codes.shape == stock_codes.shape == (16, FRAMES)
    assert torch.equal(codes, stock_codes)

    streamed = np.concatenate([f.samples for f in frames])
    assert streamed.shape == (FRAMES * 1920,)
    one_shot = engine.model.code2wav(codes[None])[0, 0].detach().numpy()
    lag = FRAMES * 1920 - one_shot.shape[0]  # 555: what a forward holds back at its end
    assert lag == 555
    np.testing.assert_allclose(streamed[lag:], one_shot, atol=1e-5)
    assert not streamed[:lag].any()  # the stream starts with the held-back length of silence
    np.testing.assert_allclose(streamed[lag:], stock_wav.numpy(), atol=1e-5)


def test_chunked_prefill_encodes_while_the_caller_talks():
    engine = engine_for(prefill_chunk_s=1.0)
    session = engine.new_session(greedy(max_answer_tokens=6, max_frames=8))
    audio = caller_audio(3.5, seed=3)

    async def turn():
        for start in range(0, len(audio), 320):
            await session.push_audio(audio[start:start + 320])
        conversation = session.context
        encoded_before_end = sum(a.shape[0] for a in conversation.turn.segment.audio)
        pending_before_end = len(conversation.pending)
        texts, frames, done = await one_turn(session, np.zeros(0, np.float32))
        return encoded_before_end, pending_before_end, frames, done

    encoded, pending, frames, done = run(turn())
    assert encoded == 3 * 13  # three 1 s chunks were encoded and prefilled before the turn ended
    assert pending == 8000  # only the last half second is left for the end of the turn
    assert len(frames) == 8 and all(f.samples.shape == (1920,) and np.isfinite(f.samples).all() for f in frames)
    assert len(done.token_ids) == 6


def test_chunked_prefill_first_tokens_equal_stock_when_off():
    engine = engine_for(prefill_chunk_s=0)
    audio = caller_audio(1.5, seed=5)
    texts, _, _ = run(one_turn(engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=5)), audio))
    stock_ids, _, _ = stock_generate(engine, greedy().instructions, [(audio, None)])
    assert [t.token_id for t in texts][:4] == stock_ids[:4]


def test_batched_code2wav_rows_that_started_at_different_frames_decode_as_their_own_streams():
    """`Code2WavRows.push`: rows whose answers started at different frames (three numbers of frames before the new
    one in a step; a group of three rows passed through the upsampler as four) decode what each row's own stream
    decodes, and rows sitting out get zeros."""
    engine = engine_for(prefill_chunk_s=0)
    model = engine.model.code2wav
    batch = Code2WavRows(model, slots=8, max_frames=32, graphs=False)
    starts = {0: 0, 1: 0, 2: 0, 3: 2, 5: 3}  # row -> the step its answer starts at; rows 4, 6 and 7 sit out
    codes = torch.randint(0, 2048, (10, 8, 16), generator=torch.Generator().manual_seed(1))  # [step, row, codes]
    own = {row: StreamingCode2Wav(model, 32) for row in starts}
    groups = set()
    with torch.inference_mode():
        for step in range(len(codes)):
            befores = [batch.rows[r].frames_before if step >= starts.get(r, len(codes)) else None for r in range(8)]
            groups.add(len({b for b in befores if b is not None}))
            out = batch.push(befores, codes[step])
            for row, start in starts.items():
                if step >= start:
                    torch.testing.assert_close(out[row], own[row].push(codes[step, row]), rtol=0, atol=1e-5)
            assert not out[[4, 6, 7]].any()
    assert 3 in groups


@pytest.mark.parametrize("context", [6])
def test_streaming_code2wav_context_is_exact(context):
    engine = engine_for(prefill_chunk_s=0)
    codes = torch.randint(0, 2048, (1, 16, 90), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        one_shot = engine.model.code2wav(codes)[0, 0]
        for ctx, exact in ((context, True), (context - 2, False)):
            stream = StreamingCode2Wav(engine.model.code2wav, 128, context=ctx)
            wav = torch.cat([stream.push(codes[0, :, k]) for k in range(codes.shape[-1])])
            error = (wav[stream.lag:] - one_shot).abs().max().item()
            assert (error < 1e-6) == exact, (ctx, error)
