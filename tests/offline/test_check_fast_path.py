"""check_fast_path's replay (studies/checks/fast_path.py): an eager answer made to take another answer's
choices reports a gap of 0 at every choice where that answer is its own, and a gap at the choice where it is not."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rtc_support import run  # a loop of its own: Playwright may hold the main thread's

from rtc_agent.engine.model.loader import load
from rtc_agent.engine.options import EngineOptions
from rtc_agent.engine.session.engine import Engine
from studies.checks import fast_path as check_fast_path


def _replay(engine_for, audio, tokens, frames):
    forced = check_fast_path._Forced(tokens, frames)
    with forced.imposed():
        replayed = run(check_fast_path._answer(engine_for(), audio, 8, 6))
    return forced.report(), replayed


def test_replay_measures_the_gap_of_every_choice():
    loaded = load("tiny", "cpu")
    audio = (0.2 * np.sin(2 * np.pi * 150 * np.arange(32000) / 16000)).astype(np.float32)
    options = EngineOptions(model="tiny", prefill_chunk_s=0, max_answer_tokens=8, max_frames=6)
    tokens, frames = run(check_fast_path._answer(Engine(loaded, options), audio, 8, 6))
    assert len(frames) == 6

    same, replayed = _replay(lambda: Engine(loaded, options), audio, tokens, frames)
    assert replayed == (tokens, frames)
    assert all(kind["differing"] == 0 and kind["max_gap"] == 0.0 for kind in same.values())
    assert same["predictor"]["choices"] == 6 * 15 and same["code0"]["choices"] == 6

    changed = [list(frame) for frame in frames]
    changed[2][5] = (changed[2][5] + 7) % 2048  # one predictor code that the eager path would not choose
    report, replayed = _replay(lambda: Engine(loaded, options), audio, tokens, [tuple(f) for f in changed])
    assert replayed[1][2][5] == changed[2][5]  # the eager path took it
    assert report["predictor"]["differing"] >= 1 and report["predictor"]["max_gap_bf16_steps"] > 4


def test_several_callers_at_once_are_checked_each_against_its_own_answer_alone(capsys):
    args = ["--model", "tiny", "--device", "cpu", "--sessions", "3", "--tokens", "6", "--frames", "4"]
    with ThreadPoolExecutor(1) as pool:  # (its asyncio.run needs a thread with no loop: Playwright may hold this one's)
        code = pool.submit(check_fast_path.main, args).result()
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["sessions"] == 3
    assert [r["tokens_equal"] and r["frames_equal"] for r in report["per_session"]] == [True] * 3
    assert all(r["frames_compared"] == 4 for r in report["per_session"])
