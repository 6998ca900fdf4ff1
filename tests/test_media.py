"""The media pieces on their own: turn detection, VAD on espeak speech, receive buffer, downmix, Opus out, pacing,
video sampling and scaling, the wire protocol and settings. Fast; no network."""
from __future__ import annotations

import asyncio
import fractions
import time

import av
import numpy as np
import pytest
from aiortc.rtp import RtpPacket

from rtc_agent.cli import parser
from rtc_agent.client.camera import SyntheticCamera
from rtc_agent.config import TurnSettings, build_settings, settings_from_args
from rtc_agent.media.ice import parse_ice_server
from rtc_agent.media.inbound import Chunker, Downmixer, InOrderAudioBuffer
from rtc_agent.media.outbound import (AWAIT_STEP, FRAME_SAMPLES, IDLE_STEP, PACKET_STEP, OpusEncoder,
                                      OutboundAudioTrack, Playout)
from rtc_agent.media.vad import CHUNK_MS, CHUNK_SAMPLES, Signal, SpeechProbability, TurnDetector
from rtc_agent.media.video import FrameGrid, model_size, sample_video
from rtc_agent.server.protocol import (CancelResponse, Commit, ProtocolError, SessionUpdate, parse_client_message,
                                       parse_offer)
from rtc_support import audio_offer, needs_espeak, run, speech

# ---- turn detection -------------------------------------------------------------------------------------------


def feed(detector: TurnDetector, probs: list[float]) -> list[tuple[int, Signal]]:
    return [(i, s) for i, p in enumerate(probs) if (s := detector.feed(p)) is not None]


def test_turn_detector_onset_confirm_and_end_after_the_hang_over() -> None:
    d = TurnDetector(threshold=0.5, silence_ms=4 * CHUNK_MS, min_speech_ms=3 * CHUNK_MS)
    got = feed(d, [0.1, 0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert got == [(1, Signal.ONSET), (3, Signal.CONFIRMED), (8, Signal.ENDED)]
    assert not d.active


def test_turn_detector_hysteresis_and_pauses_shorter_than_the_hang_over() -> None:
    d = TurnDetector(threshold=0.5, silence_ms=4 * CHUNK_MS, min_speech_ms=2 * CHUNK_MS)
    # 0.4 is neither speech nor silence; a 3-chunk pause does not end the turn; silence then counts until speech
    got = feed(d, [0.9, 0.9, 0.4, 0.4, 0.1, 0.1, 0.1, 0.9, 0.1, 0.4, 0.4, 0.4])
    assert got == [(0, Signal.ONSET), (1, Signal.CONFIRMED), (11, Signal.ENDED)]


def test_turn_detector_false_start() -> None:
    d = TurnDetector(threshold=0.5, silence_ms=3 * CHUNK_MS, min_speech_ms=4 * CHUNK_MS)
    assert feed(d, [0.9, 0.1, 0.1, 0.1]) == [(0, Signal.ONSET), (3, Signal.FALSE_START)]
    assert feed(d, [0.9]) == [(0, Signal.ONSET)]  # ready for the next one


@needs_espeak
def test_silero_on_espeak_speech_and_torch_threads_are_left_alone() -> None:
    import torch

    torch.set_num_threads(2)
    vad = SpeechProbability()
    assert torch.get_num_threads() == 2  # silero-vad's import would set 1 for the whole process
    audio = np.concatenate([np.zeros(8000, np.float32), speech(rate=16000), np.zeros(16000, np.float32)])
    n = len(audio) // CHUNK_SAMPLES
    probs = np.array([vad(audio[i * CHUNK_SAMPLES:(i + 1) * CHUNK_SAMPLES]) for i in range(n)])
    assert probs[:10].max() < 0.35 and probs[-20:].max() < 0.35  # silence before and after
    assert (probs > 0.5).sum() * CHUNK_MS > 1000  # most of the ~2 s sentence
    d = TurnDetector(0.5, TurnSettings().silence_ms, TurnSettings().min_speech_ms)
    signals = [s for p in probs if (s := d.feed(float(p)))]
    assert signals == [Signal.ONSET, Signal.CONFIRMED, Signal.ENDED]  # one turn: no split inside the sentence


# ---- inbound --------------------------------------------------------------------------------------------------


def rtp(seq: int, ts: int) -> RtpPacket:
    packet = RtpPacket(payload_type=111, sequence_number=seq, timestamp=ts)
    packet.payload = bytes([seq % 256])
    packet._data = packet.payload
    return packet


def test_in_order_buffer_hands_each_packet_on_at_once_and_drops_late_ones() -> None:
    kept: list[bool] = []
    buf = InOrderAudioBuffer(on_packet=kept.append)
    out = [buf.add(rtp(seq, seq * 960))[1] for seq in (65534, 65535, 0, 2, 1, 3, 3)]
    assert [f.timestamp if f else None for f in out] == [65534 * 960, 65535 * 960, 0, 2 * 960, None, 3 * 960, None]
    assert kept == [True, True, True, True, False, True, False]  # every arrival reported; late and duplicate dropped


def test_downmix_48k_stereo_s16_to_16k_mono_float_and_chunking() -> None:
    down, chunker = Downmixer(), Chunker(CHUNK_SAMPLES)
    t = np.arange(960 * 50) / 48000
    tone = (np.sin(2 * np.pi * 440 * t) * 16000).astype(np.int16)
    total, chunks = 0, []
    for i in range(50):
        pcm = np.repeat(tone[i * 960:(i + 1) * 960], 2).reshape(1, -1)  # packed stereo
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 48000, i * 960, fractions.Fraction(1, 48000)
        samples = down(frame)
        assert samples.dtype == np.float32
        total += len(samples)
        chunks += list(chunker.push(samples))
    assert abs(total - 16000) < 64  # the resampler holds back a few samples
    assert all(c.shape == (CHUNK_SAMPLES,) for c in chunks) and len(chunks) == total // CHUNK_SAMPLES
    assert np.max(np.abs(np.concatenate(chunks))) == pytest.approx(16000 / 32768, rel=0.05)


# ---- outbound -------------------------------------------------------------------------------------------------


def test_opus_encoder_makes_one_80ms_packet_per_frame() -> None:
    enc = OpusEncoder()
    dec = av.CodecContext.create("libopus", "r")
    dec.sample_rate, dec.layout, dec.format = 48000, "stereo", "s16"
    tone = (0.3 * np.sin(2 * np.pi * 300 * np.arange(FRAME_SAMPLES) / 24000)).astype(np.float32)
    for _ in range(3):
        packet = enc.encode(tone)
        frames = dec.decode(av.Packet(bytes(packet)))
        assert [f.samples for f in frames] == [PACKET_STEP]


def test_outbound_track_paces_packets_plays_answers_and_drops_them_on_interrupt() -> None:
    async def main() -> None:
        track = OutboundAudioTrack()
        tone = np.full(FRAME_SAMPLES, 0.2, np.float32)
        started = time.monotonic()
        packets = [await track.recv() for _ in range(3)]  # 20 ms silence packets while idle
        playout = track.start_playout()
        packets += [await track.recv() for _ in range(2)]  # 10 ms ones while the answer's first frame is awaited
        for _ in range(5):
            playout.push(tone)
        packets += [await track.recv() for _ in range(2)]  # the answer: 80 ms packets
        assert playout.frames_sent == 2 and playout.first_packet_at is not None
        assert track.interrupt() is playout
        assert playout.done.is_set() and playout.interrupted and playout.frames_dropped == 3
        packets += [await track.recv() for _ in range(2)]  # one 80 ms flush of zeros, then idle again
        elapsed = time.monotonic() - started
        steps = [IDLE_STEP] * 3 + [AWAIT_STEP] * 2 + [PACKET_STEP] * 3 + [IDLE_STEP]  # each packet's duration
        assert np.diff([p.pts for p in packets]).tolist() == steps[:-1]
        assert elapsed == pytest.approx(sum(steps[:-1]) / 48000, abs=0.04)  # paced in real time

        dec = av.CodecContext.create("libopus", "r")
        dec.sample_rate, dec.layout, dec.format = 48000, "stereo", "s16"
        decoded = [sum(f.samples for f in dec.decode(av.Packet(bytes(p)))) for p in packets]
        assert decoded == steps  # each packet decodes to exactly its timestamp step

        late = track.start_playout()  # an engine slower than real time: a gap, then a late frame
        late.push(tone)
        assert (await track.recv()).pts == packets[-1].pts + IDLE_STEP
        gap = await track.recv()  # nothing queued mid-answer: an 80 ms packet of zeros holds the slot
        late.push(tone)
        late.finish()
        await track.recv()
        assert late.done.is_set() and late.frames_sent == 2 and late.frames_late == 1
        flush, idle = await track.recv(), await track.recv()
        assert idle.pts - flush.pts == PACKET_STEP and gap.pts

        written = track.start_playout(speech=False)  # a written answer sends no frames: idle packets go on
        assert (await track.recv()).pts == idle.pts + IDLE_STEP
        assert (await track.recv()).pts == idle.pts + 2 * IDLE_STEP
        written.finish()
        track.stop()

    run(main())


def test_an_answers_first_frame_is_awaited_within_its_slot() -> None:
    """A slot while a spoken answer's first frame is on its way waits for it (the frame goes out the moment it is
    ready, with that slot's timestamp); mid-answer and written answers keep their own rules."""
    async def main() -> None:
        tone = np.full(FRAME_SAMPLES, 0.2, np.float32)
        playout = Playout()
        asyncio.get_running_loop().call_later(0.005, playout.push, tone)
        await playout.wait_for_frame(5.0)
        assert playout.queued == 1  # it waited for the frame, not for its timeout
        nothing = Playout()
        await nothing.wait_for_frame(0.001)  # none comes: back after the timeout, nothing queued
        assert nothing.queued == 0
        written = Playout(speech=False)
        asyncio.get_running_loop().call_later(0.005, written.finish)
        await written.wait_for_frame(5.0)  # a written answer has no frame to wait for: back at once
        assert not written.done.is_set()

    run(main())


# ---- video in ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size, max_side, expected", [
    ((640, 480), 384, (384, 288)),  # 4:3: (384/32) x (288/32) = 108 Thinker tokens a second at 2 fps
    ((1280, 720), 384, (384, 224)),  # 16:9: 384 x 216 rounds to 224: 84 tokens a second
    ((1920, 1080), 384, (384, 224)),
    ((480, 640), 384, (288, 384)),  # portrait
    ((641, 479), 384, (384, 288)),  # odd sizes
    ((1366, 767), 384, (384, 224)),
    ((320, 240), 384, (320, 256)),  # smaller than max_side: not scaled, only rounded to whole blocks
    ((100, 50), 384, (96, 64)),
    ((16, 16), 384, (32, 32)),  # tiny: at least one block
    ((1, 1), 384, (32, 32)),
    ((3000, 20), 384, (384, 32)),  # a sliver
    ((1920, 1080), 1280, (1280, 736)),
    ((1280, 720), 32, (32, 32)),
])
def test_model_size_fits_the_box_in_whole_vision_blocks(size: tuple[int, int], max_side: int,
                                                       expected: tuple[int, int]) -> None:
    assert model_size(*size, max_side) == expected


def test_model_size_for_every_shape() -> None:
    for width in range(1, 2000, 37):
        for height in range(1, 2000, 41):
            w, h = model_size(width, height, 384)
            assert w % 32 == 0 and h % 32 == 0 and 32 <= min(w, h) and max(w, h) <= 384, (width, height)
            scale = min(1.0, 384 / max(width, height))  # the aspect ratio holds within half a block per side
            for side, pixels in ((w, width), (h, height)):
                assert abs(side - pixels * scale) <= 16 or side == 32, (width, height)


def kept(grid: FrameGrid, times: list[float]) -> list[float]:
    return [t for t in times if grid.keep(t)]


def test_frame_grid_keeps_2_fps_of_any_faster_source_on_a_steady_grid() -> None:
    for source_fps in (7.5, 15, 24, 30, 60):
        times = [i / source_fps for i in range(int(30 * source_fps))]  # 30 s
        got = kept(FrameGrid(2.0), times)
        assert 59 <= len(got) <= 61, source_fps
        assert min(np.diff(got)) >= 0.375 - 1e-9 and max(np.diff(got)) <= 0.625 + 1 / source_fps, source_fps
    assert len(kept(FrameGrid(5.0), [i / 30 for i in range(300)])) in (50, 51)


def test_frame_grid_keeps_every_frame_of_a_jittery_2_fps_sender_and_restarts_after_a_pause() -> None:
    jitter = np.random.default_rng(1).uniform(-0.1, 0.1, 40)
    times = [0.5 * i + j for i, j in enumerate(jitter)]
    assert kept(FrameGrid(2.0), times) == times
    grid = FrameGrid(2.0)
    before = kept(grid, [i / 30 for i in range(60)])  # 2 s of video, then none for 8 s (video off)
    after = kept(grid, [10 + i / 30 for i in range(60)])
    # from the first frame after the pause on, as from the first frame of all: no burst of the missed ticks
    assert np.allclose(np.array(after) - 10, before) and len(before) in (4, 5)


def test_sampler_hands_on_rgb_frames_of_the_model_size() -> None:
    async def sample(width: int, height: int) -> tuple[list[np.ndarray], int]:
        camera, images, frames = SyntheticCamera(width, height, fps=30), [], []
        task = asyncio.ensure_future(sample_video(camera, images.append, fps=4.0, max_side=384,
                                                  on_frame=lambda: frames.append(1)))
        await asyncio.sleep(0.6)
        camera.stop()  # the track ends: the sampler returns
        await asyncio.wait_for(task, 5)
        return images, len(frames)

    async def main() -> None:
        sizes = [(640, 480), (1280, 720), (641, 479), (17, 9)]
        results = await asyncio.gather(*(sample(w, h) for w, h in sizes))
        for (width, height), (images, frames) in zip(sizes, results):
            assert 2 <= len(images) <= 4 and frames > 2 * len(images), (width, height, len(images), frames)
            w, h = model_size(width, height, 384)
            for image in images:
                assert image.shape == (h, w, 3) and image.dtype == np.uint8
            assert not np.array_equal(images[0], images[1])  # the camera's pattern moves

    run(main())


# ---- protocol and settings ------------------------------------------------------------------------------------


def test_client_messages() -> None:
    turn = TurnSettings()
    assert parse_client_message('{"type": "input_audio_buffer.commit"}', turn) == Commit()
    assert parse_client_message('{"type": "response.cancel"}', turn) == CancelResponse()
    msg = parse_client_message('{"type": "session.update", "session": {"turn_detection": '
                               '{"type": "server_vad", "silence_duration_ms": 700, "threshold": 0.6}}}', turn)
    assert isinstance(msg, SessionUpdate) and msg.turn is not None
    assert (msg.turn.silence_ms, msg.turn.vad_threshold, msg.turn.auto) == (700, 0.6, True)
    ptt = parse_client_message('{"type": "session.update", "session": {"turn_detection": null}}', turn)
    assert ptt.turn is not None and not ptt.turn.auto
    for bad in ['{"type": "session.update", "session": {"turn_detection": {"silence_duration_ms": -1}}}',
                '{"type": "session.update", "session": {"turn_detection": {"threshold": "high"}}}',
                '{"type": "session.update", "session": {"instructions": 5}}',
                '{"type": "session.update"}', '"just a string"', "{"]:
        with pytest.raises(ProtocolError):
            parse_client_message(bad, turn)
    assert parse_offer({"sdp": run(audio_offer()), "type": "offer", "voice": "aiden"}).voice == "aiden"


def test_settings_precedence_and_ice_servers(tmp_path) -> None:
    config = tmp_path / "rtc.toml"
    config.write_text('port = 9000\nvoice = "aiden"\n[turn]\nsilence_ms = 600\n')
    env = {"RTC_AGENT_PORT": "9100", "RTC_AGENT_BARGE_IN_MS": "300", "RTC_AGENT_SELF_SIGNED": "yes"}
    s = build_settings({"port": 9200, "voice": None}, env=env, config_file=str(config))
    assert (s.port, s.voice, s.turn.silence_ms, s.turn.barge_in_ms, s.self_signed) == (9200, "aiden", 600, 300, True)
    assert s.scheme == "https"
    with pytest.raises(ValueError):
        build_settings({"voice": "bob"}, env={})
    with pytest.raises(ValueError):
        build_settings({"cert": "c.pem"}, env={})
    video = build_settings({"video_max_side": 640}, env={"RTC_AGENT_VIDEO_FPS": "1.5"})
    assert (video.video_fps, video.video_max_side) == (1.5, 640)
    args = parser().parse_args(["serve", "--video-fps", "4", "--video-max-side", "448", "--video-window-s", "60"])
    from_args = settings_from_args(args)
    assert (from_args.video_fps, from_args.video_max_side, from_args.video_window_s) == (4.0, 448, 60)
    for bad, message in [({"video_max_side": 400}, "multiple of 32"), ({"video_max_side": 0}, "multiple of 32"),
                         ({"video_max_side": 4096}, "between 32 and 1280"), ({"video_fps": 0}, "video_fps"),
                         ({"video_fps": 30}, "video_fps"), ({"video_window_s": -1}, "video_window_s"),
                         ({"video_window_s": 601}, "video_window_s")]:
        with pytest.raises(ValueError, match=message):
            build_settings(bad, env={})
    # the output and memory switches: flags, environment and file, as every other setting
    config.write_text('no_talker = true\nmemory_guard_pct = 85\n')
    memory = build_settings({"gpu_memory_fraction": 0.5}, env={"RTC_AGENT_NO_AUDIO_STREAM": "1"},
                            config_file=str(config))
    assert (memory.no_talker, memory.no_audio_stream, memory.memory_guard_pct, memory.gpu_memory_fraction) == \
        (True, True, 85.0, 0.5)
    switches = settings_from_args(parser().parse_args(["serve", "--no-talker", "--no-audio-stream",
                                                       "--memory-guard-pct", "95", "--gpu-memory-fraction", "0.6"]))
    assert (switches.no_talker, switches.no_audio_stream, switches.memory_guard_pct) == (True, True, 95.0)
    assert build_settings({}, env={}).no_talker is False
    for bad, message in [({"memory_guard_pct": 5}, "memory_guard_pct"), ({"memory_guard_pct": 101}, "memory_guard_pct"),
                         ({"gpu_memory_fraction": 0}, "gpu_memory_fraction"),
                         ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction")]:
        with pytest.raises(ValueError, match=message):
            build_settings(bad, env={})
    turn = parse_ice_server("turn:alice:pw@turn.example.com:3478?transport=udp")
    assert (turn.urls, turn.username, turn.credential) == ("turn:turn.example.com:3478?transport=udp", "alice", "pw")
    assert parse_ice_server("stun:stun.example.com:3478").username is None
    with pytest.raises(ValueError):
        parse_ice_server("http://example.com")
