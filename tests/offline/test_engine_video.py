"""Caller video in the engine, on the tiny model: live frames against stock transformers given the same frames as a
video, the patch layout against the stock image processor, still seconds, the video budget, and toggling."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import caller_audio, engine_for, greedy, one_turn, run
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rtc_agent.engine.step import audio_input
from rtc_agent.engine.step.vision_input import PIXEL_MEAN, PIXEL_STD, patchify

TOKENS, FRAMES = 8, 12
HEIGHT, WIDTH = 64, 96  # 2 x 3 merged tokens per second of video on the tiny model (16-pixel patches, 2x2 merge)
PER_SECOND = 13


def camera(count: int, seed: int = 0) -> list[np.ndarray]:
    """Frames that change from one to the next: a moving gradient with noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    frames = []
    for n in range(count):
        base = np.stack([(x * 2 + n * 37) % 256, (y * 3 + n * 53) % 256, (x + y + n * 91) % 256], axis=-1)
        frames.append(np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8))
    return frames


async def call_turn(session, audio: np.ndarray, frames: list[tuple[float, np.ndarray]], audio_at: float = 0.0):
    """Push frames and 20 ms of audio at a time in media-clock order, then collect the answer."""
    pending = sorted(frames, key=lambda f: f[0])
    for start in range(0, len(audio), 320):
        now = audio_at + start / 16000
        while pending and pending[0][0] <= now:
            await session.push_image(pending[0][1], pending[0][0])
            pending.pop(0)
        await session.push_audio(audio[start:start + 320], at=now)
    return await one_turn(session, np.zeros(0, np.float32))


def interleave(audio_tokens: int, seconds: int, grid_tokens: int, ids) -> list[int]:
    """The stock processor's audio-in-video placeholder: each video second before the audio token of its time."""
    out, audio_index = [], 0
    for second in range(seconds):
        at = PER_SECOND * second
        out += [ids.audio] * (min(at, audio_tokens) - audio_index)
        audio_index = min(at, audio_tokens)
        out += [ids.video] * grid_tokens
    return out + [ids.audio] * (audio_tokens - audio_index)


def stock_video_generate(engine, audio: np.ndarray, video: list[np.ndarray], audio_in_video: bool):
    """Stock `generate(return_audio=True)` on a system prompt and one user turn with `video` (2 fps) and `audio`."""
    model, ids = engine.model, engine.ids
    mel = audio_input.log_mel(engine.feature_extractor, audio)
    audio_tokens = audio_input.token_count(mel.shape[1])
    seconds, grid_tokens = len(video) // 2, (HEIGHT // 32) * (WIDTH // 32)
    prompt = [ids.im_start, ids.system, ids.newline,
              *engine.tokenizer.encode(greedy().instructions, add_special_tokens=False), ids.im_end, ids.newline,
              ids.im_start, ids.user, ids.newline]
    if audio_in_video:
        prompt += [ids.vision_start, ids.audio_start, *interleave(audio_tokens, seconds, grid_tokens, ids),
                   ids.audio_end, ids.vision_end]
    else:
        prompt += [ids.vision_start, *[ids.video] * (seconds * grid_tokens), ids.vision_end,
                   ids.audio_start, *[ids.audio] * audio_tokens, ids.audio_end]
    prompt += [ids.im_end, ids.newline, ids.im_start, ids.assistant, ids.newline]
    pixels = torch.cat([patchify(np.stack(video[2 * s:2 * s + 2]), 16, 2, 2) for s in range(seconds)])
    recorded = {}
    original = model.code2wav.chunked_decode

    def recording_decode(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    # Stock's Talker cannot place audio next to video: its `get_rope_index` reads `config.audio_config`, which the
    # Talker's config lacks (AttributeError), and `generate` does not pass it `use_audio_in_video`. Given both,
    # the library's own code lays out the Talker's user part; that is what the engine must match.
    model.code2wav.chunked_decode = recording_decode
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    try:
        input_ids = torch.tensor([prompt])
        sequences, _ = model.generate(
            input_ids=input_ids, input_features=mel[None],
            feature_attention_mask=torch.ones(1, mel.shape[1], dtype=torch.long),
            pixel_values_videos=pixels, video_grid_thw=torch.tensor([[seconds, HEIGHT // 16, WIDTH // 16]]),
            video_second_per_grid=torch.tensor([1.0]), use_audio_in_video=audio_in_video,
            talker_use_audio_in_video=audio_in_video, speaker="ethan",
            return_audio=True, thinker_max_new_tokens=TOKENS, thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=FRAMES + 1)
    finally:
        del model.code2wav.chunked_decode
        del model.talker.config.audio_config
    return sequences[0, input_ids.shape[1]:].tolist(), recorded["codes"][0], prompt


def assert_same_answer(engine, texts, frames, stock_ids, stock_codes):
    assert [t.token_id for t in texts] == [t for t in stock_ids if t != engine.ids.im_end]
    codes = torch.tensor([f.codes for f in frames]).T
    assert codes.shape == stock_codes.shape
    assert torch.equal(codes, stock_codes)


def test_patch_layout_equals_the_stock_image_processor():
    image = camera(1)[0]
    pixels = ((image.astype(np.float32) / 255 - PIXEL_MEAN) / PIXEL_STD).transpose(2, 0, 1)
    stock, grid_h, grid_w = Qwen2VLImageProcessorPil.patchify(None, pixels, 16, 2, 2)  # a still image is 2 equal frames
    ours = patchify(np.stack([image, image]), 16, 2, 2)
    assert (grid_h, grid_w) == (HEIGHT // 16, WIDTH // 16)
    np.testing.assert_allclose(ours.numpy(), stock, atol=1e-6)


def test_frames_while_the_caller_talks_equal_stock_audio_in_video():
    engine = engine_for(prefill_chunk_s=0)
    audio, video = caller_audio(2.0, seed=7), camera(4)
    session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    texts, frames, _ = run(call_turn(session, audio, [(0.5 * n, f) for n, f in enumerate(video)]))
    stock_ids, stock_codes, prompt = stock_video_generate(engine, audio, video, audio_in_video=True)

    assert session.context.segments[1].ids == prompt[len(session.context.segments[0].ids):-3]
    assert_same_answer(engine, texts, frames, stock_ids, stock_codes)
    assert session.video_stats()["seconds_in_context"] == 2


def test_frames_before_the_caller_talks_equal_stock_video_then_audio():
    engine = engine_for(prefill_chunk_s=0)
    audio, video = caller_audio(1.5, seed=8), camera(4, seed=1)
    session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    # 2 s of camera, a second of nothing, then the caller speaks with the camera off
    texts, frames, _ = run(call_turn(session, audio, [(0.5 * n, f) for n, f in enumerate(video)], audio_at=3.0))
    stock_ids, stock_codes, prompt = stock_video_generate(engine, audio, video, audio_in_video=False)

    assert session.context.segments[1].ids == prompt[len(session.context.segments[0].ids):-3]
    assert_same_answer(engine, texts, frames, stock_ids, stock_codes)


def test_chunked_prefill_lays_out_video_as_stock_does():
    """With 1 s prefill chunks each chunk's audio is encoded on its own (as for audio alone), so the answer may
    differ from stock's; the token ids and all three rotary positions of the turn must not."""
    engine = engine_for(prefill_chunk_s=1.0)
    audio, video = caller_audio(3.5, seed=9), camera(7, seed=2)
    session = engine.new_session(greedy(max_answer_tokens=4, max_frames=4))
    run(call_turn(session, audio, [(0.5 * n, f) for n, f in enumerate(video)]))
    conversation = session.context
    system, turn = conversation.segments[0], conversation.segments[1]
    _, _, prompt = stock_video_generate(engine, audio, video[:6] + [video[6], video[6]], audio_in_video=True)

    assert turn.ids == prompt[len(system.ids):-3]
    input_ids = torch.tensor([prompt])
    mel = audio_input.log_mel(engine.feature_extractor, audio)
    stock_positions, _ = engine.model.thinker.model.get_rope_index(
        input_ids, None, torch.tensor([[4, HEIGHT // 16, WIDTH // 16]]), torch.ones_like(input_ids),
        use_audio_in_video=True, audio_seqlens=torch.tensor([mel.shape[1]]), second_per_grids=torch.tensor([1.0]))
    start = len(system.ids)
    ours = turn.positions + start  # the system prompt is sequential from 0
    np.testing.assert_array_equal(ours, stock_positions[:, 0, start:start + len(turn.ids)].long().numpy())


def test_still_seconds_cost_nothing_and_a_change_is_seen():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    still = camera(1)[0]
    rng = np.random.default_rng(0)
    noisy = [np.clip(still.astype(int) + rng.integers(-1, 2, still.shape), 0, 255).astype(np.uint8) for _ in range(8)]
    moved = camera(2, seed=5)
    frames = [(0.5 * n, f) for n, f in enumerate(noisy + moved)]  # 4 s of a still scene, then 1 s of change
    run(call_turn(session, caller_audio(5.0), frames))
    assert session.video_stats()["seconds_in_context"] == 2
    assert session.video_stats()["frames_received"] == 10


def test_video_budget_keeps_the_newest_seconds_and_their_positions():
    engine = engine_for(prefill_chunk_s=1.0, video_window_s=4, max_answer_tokens=16, max_frames=16)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    video = camera(24, seed=3)
    run(call_turn(session, caller_audio(12.0), [(0.5 * n, f) for n, f in enumerate(video)]))
    conversation = session.context
    stats = session.video_stats()
    assert 4 <= stats["seconds_in_context"] <= 6  # the window plus at most half of it before a drop
    turn = conversation.segments[1]
    video_positions = turn.positions[:, np.array(turn.ids) == engine.ids.video]
    times = sorted(set(video_positions[0].tolist()))
    block_start = turn.ids.index(engine.ids.audio_start) + 1
    # the kept seconds are the newest, each at its own time: 13 positions a second from the block start
    assert times == [block_start + PER_SECOND * s for s in range(12 - len(times), 12)]
    assert conversation.cache.length == sum(len(s.ids) for s in conversation.segments)

    # the next turn still works and starts from the context as rebuilt
    texts, frames, done = run(call_turn(session, caller_audio(1.0, seed=4), [], audio_at=20.0))
    assert len(frames) == 2 and done.token_ids


def test_a_shortened_video_window_applies_from_the_next_seconds_of_video():
    engine = engine_for(prefill_chunk_s=1.0, max_answer_tokens=16, max_frames=16)  # the 30 s default window
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    run(call_turn(session, caller_audio(6.0), [(0.5 * n, f) for n, f in enumerate(camera(12, seed=5))]))
    before = session.video_stats()["seconds_in_context"]
    assert run(session.limit_video(2)) == 2 and session.video_stats()["window_s"] == 2  # (the memory guard's cut)
    run(call_turn(session, caller_audio(6.0, seed=1), [(20.0 + 0.5 * n, f) for n, f in enumerate(camera(12, seed=6))],
                  audio_at=20.0))
    assert before >= 5 and session.video_stats()["seconds_in_context"] <= 4  # the window plus at most 2
    silent = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    run(one_turn(silent, caller_audio(1.0)))
    assert run(silent.limit_video(2)) is None  # a call without video: nothing to shorten


def test_video_off_then_on_between_turns():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    ids = engine.ids
    run(call_turn(session, caller_audio(1.0), [(0.0, camera(1)[0]), (0.5, camera(2)[1])]))
    run(call_turn(session, caller_audio(1.0, seed=1), [], audio_at=10.0))  # camera off
    run(call_turn(session, caller_audio(1.0, seed=2), [(20.0, camera(1, seed=4)[0])], audio_at=20.0))
    users = [s for s in session.context.segments if s.role == "user"]
    assert [ids.vision_start in s.ids for s in users] == [True, False, True]
    assert [s.ids.count(ids.video) for s in users] == [6, 0, 6]


def test_audio_only_call_has_no_video_tokens():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    run(one_turn(session, caller_audio(1.0)))
    turn = session.context.segments[1]
    assert engine.ids.vision_start not in turn.ids and engine.ids.video not in turn.ids
    assert session.video_stats() == {"frames_received": 0, "last_at": None, "seconds_in_context": 0,
                                     "tokens_in_context": 0, "window_s": 30}


@pytest.mark.parametrize("image, at, message", [
    (np.zeros((64, 96), np.uint8), 0.0, "RGB"),
    (np.zeros((64, 96, 3), np.float32), 0.0, "uint8"),
    (np.zeros((0, 96, 3), np.uint8), 0.0, "pixels a side"),
    ([[0]], 0.0, "numpy array"),
    (np.zeros((64, 96, 3), np.uint8), float("nan"), "media-clock"),
    (np.zeros((64, 96, 3), np.uint8), -1.0, "media-clock"),
])
def test_bad_frames_are_refused_and_change_nothing(image, at, message):
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    with pytest.raises(ValueError, match=message):
        run(session.push_image(image, at))
    texts, frames, done = run(one_turn(session, caller_audio(1.0)))
    assert len(frames) == 2 and session.video_stats()["frames_received"] == 0


def test_odd_sizes_are_rounded_to_whole_patches():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(greedy(max_answer_tokens=2, max_frames=2))
    odd = np.full((70, 100, 3), 128, np.uint8)  # rounds to 64 x 96
    run(call_turn(session, caller_audio(1.0), [(0.0, odd)]))
    assert session.video_stats()["tokens_in_context"] == 6


def test_graphed_video_prefills_run_the_same_arithmetic():
    """On the GPU a turn's video goes through padded prefill graphs at TMRoPE positions: run here eagerly (the code
    the graphs capture), the answer equals stock's."""
    engine = engine_for(prefill_chunk_s=0)
    audio, video = caller_audio(2.0, seed=7), camera(4)
    session = engine.new_session(greedy(max_answer_tokens=TOKENS, max_frames=FRAMES))
    slot = session._slot
    slot.video_prefill = engine.pool.video_prefill(slot.cache, size=64, graph=False)
    slot.talker._video_graph = slot.talker.video_prefill(size=64, graph=False)
    calls = []
    for graph in (slot.video_prefill, slot.talker._video_graph):
        graph.step.fn = lambda *inputs, fn=graph.step.fn: calls.append(inputs[0].shape[1]) or fn(*inputs)
    texts, frames, _ = run(call_turn(session, audio, [(0.5 * n, f) for n, f in enumerate(video)]))
    stock_ids, stock_codes, _ = stock_video_generate(engine, audio, video, audio_in_video=True)

    assert calls == [64, 64]  # the turn's prefill in the Thinker and in the Talker, each padded
    assert_same_answer(engine, texts, frames, stock_ids, stock_codes)
