"""semantic_vad: the Smart Turn end-of-turn model on real espeak-ng speech, a real aiortc call over loopback whose
mid-sentence pause does not end the turn, barge-in, and session.update switching turn detection."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from rtc_support import (
    caller,
    metric,
    metrics_text,
    needs_espeak,
    restore_ice,  # noqa: F401  (autouse fixture)
    run,
    say,
    server,
)
from transformers import WhisperFeatureExtractor

from rtc_agent.client.microphone import RATE, load_audio
from rtc_agent.config import TurnSettings, build_settings
from rtc_agent.engine import Engine, EngineOptions
from rtc_agent.engine.step.turn_scoring import DeviceTurnModel, TurnScoring, end_of_turn_mode
from rtc_agent.media.end_of_turn import (
    EAGERNESS,
    SCORING_NICE,
    WIDE_THREADS,
    EndOfTurnModel,
    EndOfTurnScorer,
    SemanticTurn,
    shared_scorer,
)
from rtc_agent.smart_turn import model_path, windows
from rtc_agent.server.protocol import ProtocolError, parse_client_message, turn_description
from rtc_agent.server.state import STATE

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
QUESTION = "What is the weather like in Paris tomorrow?"
# A pause where the sentence plainly goes on: the model scores the part before it "incomplete" (0.01 here).
PAUSED = ("My daughter wants to become", 900, "a veterinary surgeon.")


def ssml_speech(before: str, pause_ms: int, after: str, rate: int) -> np.ndarray:
    """espeak-ng saying `before`, an SSML break of `pause_ms`, then `after`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "paused.wav"
        ssml = f'<speak>{before} <break time="{pause_ms}ms"/> {after}</speak>'
        subprocess.run(["espeak-ng", "-m", "-w", str(path), ssml], check=True, capture_output=True)
        return load_audio(str(path), rate)


def gap(samples: np.ndarray, rate: int) -> tuple[int, int]:
    """The longest run of silence inside the speech: (its first sample, its length)."""
    loud = np.flatnonzero(np.abs(samples) > 0.01)
    i = int(np.argmax(np.diff(loud)))
    return int(loud[i]), int(loud[i + 1] - loud[i])


def timeline(call) -> list[tuple[float, str, str]]:
    """The call's events so far, for a failure's message: (time, type, state), transcript deltas left out."""
    return [(round(t, 2), e["type"], e.get("state", "")) for t, e in call.events if not e["type"].endswith("delta")]


def espeak(text: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "said.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        return load_audio(str(path), 16_000)


async def one_turn_over_a_pause(call, mic, timeout_s: float) -> dict:
    """Says the PAUSED sentence; its answer's `response` once one turn has ended, after the real end."""
    samples = ssml_speech(*PAUSED, rate=RATE)
    start, length = gap(samples, RATE)
    at = mic.play(samples)
    pause_end_at = mic.time_at(at + start + length)
    done = (await call.next_event("response.done", timeout_s=timeout_s))["response"]
    committed = [t for t, e in call.events if e["type"] == "input_audio_buffer.committed"]
    assert len(committed) == 1 and committed[0] > pause_end_at, timeline(call)  # one turn, after the real end
    return done


def question_turns(*silences_ms: int) -> list[np.ndarray]:
    """QUESTION said by espeak-ng, cut that many ms of silence after its last sound (16 kHz)."""
    question = espeak(QUESTION)
    end = int(np.flatnonzero(np.abs(question) > 0.01)[-1])
    return [question[:end + 16 * ms] for ms in silences_ms]


def test_the_model_scores_a_complete_question_high_and_a_sentence_cut_in_its_pause_low() -> None:
    scorer = shared_scorer()
    complete = scorer.score_now(question_turns(160)[0])  # 160 ms into the silence after it
    paused = ssml_speech(*PAUSED, rate=16_000)
    start, length = gap(paused, 16_000)
    assert length > 16 * 800
    cut = scorer.score_now(paused[:start + 16 * 160])  # 160 ms into the mid-sentence break
    assert complete.probability > 0.8 and cut.probability < 0.3, (complete, cut)
    assert complete.cost_ms > 0


def test_the_engines_torch_run_of_the_model_file_agrees_with_onnxruntime_within_its_quantization_noise() -> None:
    """engine/step/turn_scoring.py runs the same int8 file as torch ops (engine/step/onnx_torch.py; here on the
    CPU). Each activation is rounded to its int8 grid, so float sums in another order move a value by a grid step
    now and then: onnxruntime's own fused kernels and its unfused reference differ by up to 0.08 on these turns.
    The features are made in torch too (audio_input.LogMel), as transformers' extractor makes them."""
    paused = ssml_speech(*PAUSED, rate=16_000)
    start, _ = gap(paused, 16_000)
    complete = question_turns(64, 160, 320)
    cut = [paused[:start + 16 * ms] for ms in (64, 160, 320)]
    turns = complete + cut
    reference = WhisperFeatureExtractor(feature_size=80, sampling_rate=16_000, chunk_length=8)(
        list(windows(turns)), sampling_rate=16_000, return_tensors="np", do_normalize=True).input_features
    onnxruntime, on_device = EndOfTurnModel(), DeviceTurnModel(torch.device("cpu"))
    assert np.abs(on_device.features(torch.from_numpy(windows(turns))).numpy() - reference).max() < 1e-4
    expected = np.array([onnxruntime(audio) for audio in complete + cut])
    together = np.array(on_device(complete + cut))
    alone = np.array([on_device([audio])[0] for audio in complete + cut])
    assert np.abs(together - alone).max() < 1e-4  # a batch gives each turn its own verdict
    assert np.abs(together - expected).max() < 0.1 and np.abs(together - expected).mean() < 0.04, (together, expected)
    assert (together[:3] > 0.8).all() and (together[3:] < 0.3).all(), together


def test_each_activations_quantize_dequantize_pair_runs_fused_with_the_same_values() -> None:
    """The torch run fuses each QuantizeLinear / DequantizeLinear pair of an activation into four ops; on the
    file's own scales and zero points, over values on and between the grid's rounding points and past its range,
    they give what the two ONNX operators give one after the other."""
    from rtc_agent.engine.step import onnx_torch

    graph = onnx_torch.TorchGraph(model_path())
    pairs = [(inputs, attrs) for op, inputs, _, attrs in graph._nodes if op is onnx_torch._quantize_dequantize]
    assert len(pairs) == 78 and not any(op is onnx_torch._quantize for op, *_ in graph._nodes)
    for inputs, attrs in pairs:
        scale, zero = graph._constants[inputs[1]], graph._constants[inputs[2]]
        grid = torch.arange(-300, 300, 0.25) * scale  # (x.5 steps: rounding to even)
        x = torch.cat([grid, torch.randn(1000) * scale * 50, torch.tensor([0.0, -0.0, 1e30, -1e30])])
        two_ops = onnx_torch._dequantize(onnx_torch._quantize(x, scale, zero, **attrs), scale, zero)
        fused = onnx_torch._quantize_dequantize(x.clone(), scale, zero, **attrs)
        assert torch.equal(fused, two_ops), inputs


def test_windows_written_into_a_reused_buffer_equal_fresh_ones() -> None:
    """The engine's scorer writes each batch's windows into one pinned buffer: rows that held a longer turn before
    must come out as the fresh windows (zeros in front), and the rows past the batch stay as they were."""
    turns = [np.full(16_000 * 9, 0.5, np.float32), np.full(16_000 // 2, -0.25, np.float32), np.zeros(0, np.float32)]
    buffer = np.full((4, 16_000 * 8), 7.0, np.float32)
    written = windows(turns, out=buffer)
    assert written.shape == (3, 16_000 * 8) and np.shares_memory(written, buffer)
    assert np.array_equal(written, windows(turns))
    assert (buffer[3] == 7.0).all()


def test_warm_up_runs_the_process_model_once_on_each_thread_count_and_never_asks_the_engine() -> None:
    """Server start-up (`warm_up_media`): a process's first verdict is the model's first run, slower than the rest."""
    runs: list[int] = []

    def model(audio: np.ndarray, threads: int) -> float:
        runs.append(threads)
        return 0.5

    async def engine(audio: np.ndarray) -> tuple[float, float]:
        raise AssertionError("the warm-up asked the engine")

    EndOfTurnScorer(model, engine=engine, local=1).warm_up()
    assert runs == [1, WIDE_THREADS]
    EndOfTurnScorer(None, engine=engine, local=0).warm_up()  # (every verdict from the engine: nothing to warm)
    assert runs == [1, WIDE_THREADS]


@pytest.mark.parametrize("where", ["engine", "overflow"])
def test_an_engine_that_scores_turns_ends_a_calls_turn_on_its_verdicts_not_on_a_pause(where: str) -> None:
    """--end-of-turn-on engine: the media side sends the turn's audio to the engine, which scores every call's
    turns in batches on its own thread; here the tiny engine on the CPU. overflow (the default on a GPU): a lone
    call's decisions, one at a time, stay on the media side's threads."""
    scoring = Engine.load(EngineOptions(model="tiny", device="cpu", max_sessions=2, max_answer_tokens=8,
                                        end_of_turn=where))

    async def main() -> None:
        async with server(engine_=scoring, turn_detection="semantic_vad", max_answer_s=2.0) as (url, app), \
                caller(url) as (call, mic):
            assert app[STATE].engine.describe()["end_of_turn"] == where
            assert app[STATE].end_of_turn.local == (0 if where == "engine" else 1)  # decisions at once here
            done = await one_turn_over_a_pause(call, mic, timeout_s=60)
            eot = done["metrics"]["end_of_turn"]
            assert eot["type"] == "semantic_vad" and eot["decisions"] >= 1, eot
            assert min(eot["decision_cpu_ms"]) > 0, eot
            if where == "engine":
                assert set(eot["decision_threads"]) == {0}, eot  # 0: the engine's
                assert scoring.turn_scoring.batches >= eot["decisions"]
            else:
                assert 0 not in eot["decision_threads"] and scoring.turn_scoring.batches == 0, eot

    try:
        run(main(), timeout_s=200)
    finally:
        scoring.close()


def test_with_the_engine_taking_the_overflow_a_process_scores_one_turn_at_a_time_and_the_engine_the_others() -> None:
    """The default on a GPU (overflow): a decision asked for while another of the process is on its way goes to
    the engine's scorer (here its torch run on the CPU), which agrees with onnxruntime within the int8 grid's
    noise (the test above); once the process's own decision is back, the next is its own again."""
    assert [end_of_turn_mode("auto", torch.device(d)) for d in ("cpu", "cuda")] == ["media", "overflow"]
    turns = question_turns(96, 160, 320)
    expected = [EndOfTurnModel()(audio) for audio in turns]
    scoring = TurnScoring.load(torch.device("cpu"))
    scorer = EndOfTurnScorer(EndOfTurnModel(), engine=scoring.score, local=1)

    async def main() -> None:
        burst = await asyncio.gather(*(scorer.score(audio) for audio in turns))
        assert [d.threads for d in burst[1:]] == [0, 0], burst  # the others there (the first: whichever was first)
        assert burst[0].probability == expected[0] or burst[0].threads == 0
        assert np.abs(np.array([d.probability for d in burst]) - expected).max() < 0.1, (burst, expected)
        assert scoring.batches >= 1
        alone = await scorer.score(turns[2])
        assert alone.threads > 0 and alone.probability == expected[2]

    try:
        run(main())
    finally:
        scoring.close()
    with pytest.raises(ValueError):
        EndOfTurnScorer(None, local=1)
    with pytest.raises(ValueError):
        EndOfTurnScorer(None, engine=scoring.score, local=1)  # (no model here: every verdict from the engine)
    with pytest.raises(ValueError):
        EndOfTurnScorer(EndOfTurnModel(), engine=scoring.score)  # (an engine without a bound on local decisions)


def test_a_decision_under_way_here_when_others_go_to_the_engine_takes_the_engines_verdict_if_it_comes_first() -> None:
    """A process's own decision held on its thread (a busy CPU): once a second turn goes to the engine, the first
    is asked of the engine too and answered from there; its run here, still going, keeps the next turn on the
    engine until it ends. With the engine failing, the run here answers."""
    turns = question_turns(96, 160)
    model = EndOfTurnModel()
    expected = [model(audio) for audio in turns]
    held = threading.Event()

    def busy_model(audio: np.ndarray, threads: int) -> float:
        assert held.wait(60)
        return model(audio, threads)

    scoring = TurnScoring.load(torch.device("cpu"))
    scorer = EndOfTurnScorer(busy_model, engine=scoring.score, local=1)

    async def main() -> None:
        first = asyncio.ensure_future(scorer.score(turns[0]))
        await asyncio.sleep(0.05)
        assert not first.done()  # (its run here is held)
        second = await scorer.score(turns[1])
        decision = await asyncio.wait_for(first, 60)
        assert (decision.threads, second.threads) == (0, 0)
        assert abs(decision.probability - expected[0]) < 0.1, (decision, expected)
        assert scoring.batches >= 1
        third = await scorer.score(turns[1])  # (the first's run is still held here)
        assert third.threads == 0
        held.set()
        while scorer._asked_here:  # (the held run ends; its verdict is not wanted)
            await asyncio.sleep(0.01)
        alone = await scorer.score(turns[1])
        assert alone.threads > 0 and alone.probability == expected[1]

        held.clear()
        scoring.close()  # the engine fails: the run here answers the turn under way
        first = asyncio.ensure_future(scorer.score(turns[0]))
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="closed"):
            await scorer.score(turns[1])
        await asyncio.sleep(0.05)
        assert not first.done()
        held.set()
        decision = await asyncio.wait_for(first, 60)
        assert decision.threads > 0 and decision.probability == expected[0]

    try:
        run(main())
    finally:
        held.set()
        scoring.close()


def test_decisions_that_come_back_out_of_order_each_get_their_verdict() -> None:
    """Two decisions on a process's threads at once (two calls' turns end together, no engine), the later one back
    first: each gets its own verdict, and so do the decisions after them."""
    turns = question_turns(96, 160)
    model = EndOfTurnModel()
    expected = [model(audio) for audio in turns]
    held = threading.Event()

    def first_held(audio: np.ndarray, threads: int) -> float:  # the real model; the first turn's run waits
        if len(audio) == len(turns[0]):
            assert held.wait(60)
        return model(audio, threads)

    scorer = EndOfTurnScorer(first_held)

    async def main() -> None:
        first = asyncio.ensure_future(scorer.score(turns[0]))
        await asyncio.sleep(0.05)
        second = await asyncio.wait_for(scorer.score(turns[1]), 60)  # back while the first still runs
        assert not first.done() and second.probability == expected[1]
        held.set()
        assert (await asyncio.wait_for(first, 60)).probability == expected[0]
        assert not scorer._asked_here
        assert (await asyncio.wait_for(scorer.score(turns[1]), 60)).probability == expected[1]

    try:
        run(main())
    finally:
        held.set()


def test_the_only_calls_lone_decision_runs_on_two_threads_with_the_same_verdict_others_on_one() -> None:
    model = EndOfTurnModel()
    audio = ssml_speech(*PAUSED, rate=16_000)
    assert model(audio, WIDE_THREADS) == model(audio, 1)
    inside = threading.Barrier(2, timeout=30)
    threads: list[int] = []

    def meeting(samples: np.ndarray, count: int) -> float:  # the real model, once both decisions are in it
        threads.append(count)
        inside.wait()
        return model(samples, count)

    scorer = EndOfTurnScorer(meeting)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two decisions at once: one on two threads
        both = list(pool.map(scorer.score_now, [audio, audio]))
    assert sorted(threads) == [1, WIDE_THREADS] and sorted(d.threads for d in both) == [1, WIDE_THREADS]
    assert both[0].probability == both[1].probability
    inside = threading.Barrier(1)
    alone = scorer.score_now(audio)
    assert alone.threads == WIDE_THREADS and alone.probability == both[0].probability and alone.cost_ms > 0
    calls = [SemanticTurn(scorer, EAGERNESS["auto"], lambda: None) for _ in range(2)]
    assert scorer.calls == 2 and scorer.score_now(audio).threads == 1  # two calls in the process: one thread
    calls[1].close()
    calls[1].close()
    assert scorer.calls == 1 and scorer.score_now(audio).threads == WIDE_THREADS
    calls[0].close()
    assert scorer.calls == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_decisions_run_at_a_lower_cpu_priority_than_the_thread_that_asks_for_them() -> None:
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    scorer = EndOfTurnScorer(lambda audio, threads: float(nice()))  # the verdict: the scoring thread's nice value
    asked_from = nice()
    decision = run(scorer.score(np.zeros(1600, np.float32)))  # (asked for from a thread at the same nice value)
    assert SCORING_NICE > 0 and decision.probability == min(asked_from + SCORING_NICE, 19)
    assert nice() == asked_from  # the asking thread keeps its own


def test_session_update_switches_turn_detection_and_rejects_bad_values() -> None:
    turn = TurnSettings(turn_detection="server_vad")

    def update(td: object) -> TurnSettings:
        import json

        msg = parse_client_message(json.dumps({"type": "session.update", "session": {"turn_detection": td}}), turn)
        return msg.turn

    semantic = update({"type": "semantic_vad", "eagerness": "high"})
    assert (semantic.turn_detection, semantic.eagerness, semantic.auto) == ("semantic_vad", "high", True)
    assert turn_description(semantic) == {"type": "semantic_vad", "eagerness": "high", "threshold": 0.5,
                                          "prefix_padding_ms": 300, "min_speech_duration_ms": 128,
                                          "barge_in_ms": 256}
    back = update({"type": "server_vad", "silence_duration_ms": 500})
    assert (back.turn_detection, back.silence_ms) == ("server_vad", 500)
    for bad, code in [({"type": "semantic_vad", "eagerness": "fast"}, "invalid_value"),
                      ({"type": "semantic_vad", "eagerness": 2}, "invalid_value"),
                      ({"type": "semantic_vad", "silence_duration_ms": 300}, "unknown_parameter"),
                      ({"type": "server_vad", "eagerness": "low"}, "unknown_parameter"),
                      ({"type": "smart_vad"}, "invalid_value")]:
        with pytest.raises(ProtocolError) as err:
            update(bad)
        assert err.value.code == code, bad


def test_turn_detection_from_flags_environment_and_file(tmp_path: Path) -> None:
    assert (TurnSettings().turn_detection, TurnSettings().eagerness) == ("semantic_vad", "auto")
    config = tmp_path / "agent.toml"
    config.write_text('[turn]\nturn_detection = "semantic_vad"\neagerness = "low"\n')
    s = build_settings({"eagerness": "high"}, env={"RTC_AGENT_TURN_DETECTION": "server_vad"}, config_file=str(config))
    assert (s.turn.turn_detection, s.turn.eagerness) == ("server_vad", "high")
    for bad in ({"eagerness": "eventually"}, {"turn_detection": "smart_vad"}):
        with pytest.raises(ValueError):
            build_settings(bad, env={})


def test_a_mid_sentence_pause_does_not_end_the_turn_then_barge_in_still_cuts_the_answer() -> None:
    async def main() -> None:
        async with server(turn_detection="semantic_vad", max_answer_s=8.0, last_words=True) as (url, _), \
                caller(url) as (call, mic):
            created = (await call.next_event("session.created", timeout_s=10))["session"]
            assert created["turn_detection"]["type"] == "semantic_vad"
            assert created["turn_detection"]["eagerness"] == "auto"

            done = await one_turn_over_a_pause(call, mic, timeout_s=30)
            assert len(call.events_of("input_audio_buffer.speech_started")) == 1
            stopped = call.events_of("input_audio_buffer.speech_stopped")
            assert len(stopped) == 1
            eot = done["metrics"]["end_of_turn"]
            assert eot["type"] == "semantic_vad" and eot["eagerness"] == "auto" and eot["decisions"] >= 1
            assert 0 <= eot["probability"] <= 1 and 0 < eot["wait_ms"] <= 3000
            # the last words heard, at the turn's real end: the whole sentence, which can end there
            assert "surgeon" in eot["words"].lower() and eot["words_unfinished"] is False, eot
            assert eot["words_cpu_ms"] > 0
            text = await metrics_text(url)
            assert metric(text, 'rtc_agent_end_of_turn_wait_ms_count{type="semantic_vad"}') == 1.0

            # barge-in works as with server_vad: speech during the answer cuts it and is the next turn
            await say(call, mic, "Please tell me everything about Paris.")
            while (await call.next_event("conversation.state", timeout_s=30))["state"] != "speaking":
                pass
            await asyncio.sleep(0.5)
            # one run of speech with no pause in it: semantic_vad would end a turn at a pause after "Stop,"
            await say(call, mic, "Please wait a moment because I have another question for you.")
            cut = (await call.next_event("response.done", timeout_s=30))["response"]
            assert cut["interrupted"] and cut["status"] == "cancelled", (cut, timeline(call))
            nxt = (await call.next_event("response.done", timeout_s=30))["response"]
            assert nxt["metrics"]["frames_sent"] > 0 and nxt["metrics"]["end_of_turn"]["type"] == "semantic_vad"

            # switching per call: server_vad, then a bad eagerness (an error, nothing changes)
            call.send({"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}})
            updated = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert updated["turn_detection"]["type"] == "server_vad"
            call.send({"type": "session.update",
                       "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "eventually"}}})
            err = await call.next_event("error", timeout_s=10)
            assert err["error"]["code"] == "invalid_value"
            call.send({"type": "session.update", "session": {"voice": "aiden"}})
            unchanged = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert unchanged["turn_detection"]["type"] == "server_vad"

    run(main(), timeout_s=200)


def test_verdicts_come_at_the_eagerness_check_points_and_a_resumed_pause_voids_them() -> None:
    """SemanticTurn on the real model: it asks for verdicts at the silences the eagerness names (one at a time),
    ends the turn at the first verdict that the eagerness's rule (threshold, mean of the latest verdicts) says
    ends it, and ignores a verdict that comes back after the caller spoke again."""
    scorer = shared_scorer()
    eagerness = EAGERNESS["auto"]
    audio = ssml_speech(*PAUSED, rate=16_000)
    start, _ = gap(audio, 16_000)

    async def main() -> None:
        ended: list[int] = []
        turn = SemanticTurn(scorer, eagerness, lambda: ended.append(silence))
        turn.start([audio[:start + 16 * 100]])  # the turn so far: speech up to "... to become", then silence
        checks: list[tuple[int, float]] = []
        for silence in range(32, eagerness.patient_ms + 32 * 8, 32):
            turn.silence(silence)
            await asyncio.gather(*turn._tasks)  # each verdict back before the next chunk: no timing involved
            if len(turn.decisions) > len(checks):
                assert turn.checked_at_ms is not None and turn.probability is not None
                checks.append((turn.checked_at_ms, turn.probability))
            if ended:
                break
        def at_chunk(ms: int) -> int:  # a verdict is asked for at the first 32 ms chunk that reaches its silence
            return -(-ms // 32) * 32

        points = [eagerness.first_check_ms]
        while len(points) < len(checks):
            points.append(eagerness.next_check_ms(points[-1]))
        assert [c[0] for c in checks] == [at_chunk(p) for p in points]
        scores = [p for _, p in checks]
        assert not any(eagerness.ends_turn(scores[:i], checks[i - 1][0]) for i in range(1, len(checks)))
        assert eagerness.ends_turn(scores, checks[-1][0]) == bool(ended)

        turn.start([audio])  # a new turn; speech resumes while its first verdict is on its way
        turn.silence(eagerness.first_check_ms)
        pending = list(turn._tasks)
        turn.silence(0)
        await asyncio.gather(*pending)
        assert turn.decisions == [] and turn.probability is None
        turn.close()

    run(main(), timeout_s=120)


def test_a_verdict_back_before_96_ms_of_silence_ends_the_turn_only_if_the_silence_lasts_that_long() -> None:
    """A short gap inside a sentence can read as exactly 64 ms of silence, the first check: a "complete" verdict
    that comes back before the next chunk waits for it, and speech there drops it, as it drops a slower verdict."""
    scorer = EndOfTurnScorer(lambda audio, threads: 0.99)  # every verdict: complete

    async def main() -> None:
        ended: list[int] = []
        silence = 0
        turn = SemanticTurn(scorer, EAGERNESS["auto"], lambda: ended.append(silence))
        turn.start([np.zeros(16_000, np.float32)])
        for silence in (32, 64, 0):  # the gap: 64 ms, then the caller goes on
            turn.silence(silence)
            await asyncio.gather(*turn._tasks)  # the verdict is back before the next chunk
        assert ended == [] and turn.probability == 0.99
        for silence in (32, 64, 96):  # the real end
            turn.silence(silence)
            await asyncio.gather(*turn._tasks)
            assert ended == ([96] if silence == 96 else [])
        turn.close()

    run(main(), timeout_s=60)


def test_slow_verdicts_make_the_checks_later_never_fewer() -> None:
    """SemanticTurn on the real model, its verdicts slow: each is back 160 ms of silence after it was asked for
    (the chunks of a simulated clock go on while it is on its way, as on a busy CPU). A check point that passed
    meanwhile is asked for at the first chunk once that verdict is back, so every early point of the eagerness
    gets a verdict (auto: the points 64, 128, 192 ms, asked for at 64, 224 and 384 ms), then the late ones.
    (Counting the next point from the silence of a late ask, as before, skipped the early point 192 ms.)"""
    scorer = shared_scorer()
    eagerness = EAGERNESS["auto"]
    audio = ssml_speech(*PAUSED, rate=16_000)
    start, _ = gap(audio, 16_000)
    delay_ms = 160

    async def main() -> None:
        turn = SemanticTurn(scorer, eagerness, lambda: pytest.fail("a sentence cut in its pause ended the turn"))
        turn.start([audio[:start + 16 * 100]])  # speech up to "... to become", then silence: scored incomplete
        asked: list[int] = []
        for silence in range(32, eagerness.patient_ms + eagerness.late_recheck_ms + 32, 32):
            if turn._tasks and silence >= asked[-1] + delay_ms:  # the verdict on its way is back by this chunk
                await asyncio.gather(*turn._tasks)
                assert turn.checked_at_ms == asked[-1]
            on_its_way = set(turn._tasks)
            turn.silence(silence)
            if set(turn._tasks) - on_its_way:
                asked.append(silence)
        await asyncio.gather(*turn._tasks)
        assert asked == [64, 224, 384, 1120, 1600]  # the early points each once the verdict before is back
        points = [eagerness.first_check_ms]
        while len(points) < len(asked):
            points.append(eagerness.next_check_ms(points[-1]))
        assert points == [64, 128, 192, 1100, 1580]
        assert len(turn.decisions) == len(asked)
        turn.close()

    run(main(), timeout_s=120)
