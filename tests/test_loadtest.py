"""`rtc-agent loadtest` as a user runs it (a subprocess), against a real server (tiny model) over loopback."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest


from rtc_agent.client import loadtest as client_loadtest
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import SENTENCE, needs_espeak, run, server, wait_ready

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def wav(tmp_path: Path) -> str:
    path = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), SENTENCE], check=True, capture_output=True)
    return str(path)


async def loadtest(url: str, *args: str) -> tuple[int, str, str]:
    await wait_ready(url)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rtc_agent.cli", "loadtest", url, "--ice-host-address", "127.0.0.1", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


@needs_espeak
def test_two_callers_both_get_answers_and_the_json_has_every_field(wav: str) -> None:
    async def main_() -> None:
        async with server(max_sessions=2) as (url, _):
            code, out, err = await loadtest(url, "--callers", "2", "--wav", wav, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["settings"]["callers"] == 2 and report["utterances"] == 1
        overall = report["overall"]
        assert (overall["callers"], overall["connected"], overall["failed"], overall["failures"]) == (2, 2, 0, {})
        assert (overall["turns"], overall["answered"], overall["cut_ins"]) == (2, 2, 0)
        for key in ("heard_ms", "server_ttfp_ms", "engine_ttfp_ms", "engine_frame_ms_p90", "interval_ms_p90",
                    "end_of_turn_wait_ms"):
            assert overall[key]["n"] == 2 and 0 < overall[key]["p50"] <= overall[key]["p90"] <= overall[key]["max"]
        assert overall["end_of_turn_wait_ms"]["p50"] == 400  # server_vad's silence (the test server's turns)
        assert overall["verdict_ms"]["n"] == 0  # (semantic_vad's alone)
        assert overall["frames_sent"] > 0 and overall["frames_dropped"] == 0
        assert {"frames_late", "gaps", "max_gap_ms", "client_loop_lag_ms_max"} <= overall.keys()
        assert overall["server_loop_lag_ms_max"] >= 0  # the server's own measure, through response.done
        ends = [c["turns"][0]["speech_end_monotonic_s"] for c in report["callers"]]
        assert overall["speech_end_spread_ms"] == [round((max(ends) - min(ends)) * 1000, 1)]
        spent = report["server_processes"]["server"]  # (one process: no `process` label)
        assert spent["loop_wakeups"] > 0 and spent["loop_lag_ms_at_most"] is not None
        assert spent["gc_pause_ms_at_most"] is not None  # (young collections run all the time)

        callers = report["callers"]
        assert [c["caller"] for c in callers] == [0, 1]
        assert len({c["session_id"] for c in callers}) == 2
        for c in callers:
            assert c["failure"] is None and c["connected_ms"] > 0 and c["attempts"] == 1
            (turn,) = c["turns"]
            assert turn["status"] == "incomplete" and turn["client_latency_ms"] > 0
            assert turn["server"]["ttfp_ms"] > 0 and turn["server"]["frames_sent"] > 0
            # the caller received the answer the server says it sent (plus the encoder's flush packet)
            assert turn["answer_packets"] >= turn["server"]["frames_sent"]
            assert turn["gaps"] >= 0 and 0 < turn["interval_ms_p90"] <= turn["max_gap_ms"]
            assert c["summary"]["answered"] == 1

    run(main_())


@needs_espeak
def test_an_answer_over_the_caller_is_a_cut_in_and_the_turn_waits_for_the_answer_after_the_real_end(
        tmp_path: Path) -> None:
    """A pause inside the utterance longer than server_vad's silence ends the turn there: the answer starts, the
    caller's next words cut it (barge-in). The load tester counts that as a cut-in and takes the answer that came
    after the utterance's real end as the turn's, with its heard latency."""
    path = tmp_path / "paused.wav"
    ssml = '<speak>I would like to book a table <break time="700ms"/> for four people tonight.</speak>'
    subprocess.run(["espeak-ng", "-m", "-w", str(path), ssml], check=True, capture_output=True)

    async def main_() -> None:
        async with server(max_sessions=1, silence_ms=300, max_answer_s=2.0) as (url, _):
            code, out, err = await loadtest(url, "--callers", "1", "--wav", str(path), "--json")
        assert code == 0, err
        report = json.loads(out)
        (turn,) = report["callers"][0]["turns"]
        assert turn["cut_ins"] == 1 and turn["status"] == "incomplete", turn
        assert turn["client_latency_ms"] is not None and turn["client_latency_ms"] > 0
        assert report["overall"]["cut_ins"] == 1 and report["overall"]["answered"] == 1

    run(main_())


@needs_espeak
def test_callers_beyond_max_sessions_are_reported_as_server_full_failures(wav: str) -> None:
    async def main_() -> None:
        async with server(max_sessions=1) as (url, _):
            code, out, err = await loadtest(url, "--callers", "2", "--wav", wav)
        assert code == 1, err  # a failed caller fails the run, without a traceback
        assert "Traceback" not in err
        lines = out.splitlines()
        refused = [line for line in lines if "server_full" in line and "Retry-After 10 s" in line]
        answered = [line for line in lines if "sess_" in line and " 1/1 " in line]
        assert len(refused) == 1 and len(answered) == 1, out
        assert any(line.startswith("overall: 1/2 connected, 1 failed (1 server_full)") for line in lines), out

    run(main_())


@needs_espeak
def test_with_retry_s_a_refused_caller_comes_back_after_retry_after(wav: str) -> None:
    async def main_() -> None:
        async with server(max_sessions=1) as (url, _):
            code, out, err = await loadtest(url, "--callers", "2", "--wav", wav, "--retry-s", "30", "--json")
        assert code == 0, err
        callers = json.loads(out)["callers"]
        first, second = sorted(c["attempts"] for c in callers)
        assert first == 1 and second >= 2  # the second waited (Retry-After) until the first had hung up
        assert all(c["failure"] is None and c["summary"]["answered"] == 1 for c in callers)

    run(main_())


@needs_espeak
def test_callers_spread_over_two_client_processes_are_reported_as_one_run(wav: str) -> None:
    async def main_() -> None:
        async with server(max_sessions=2) as (url, _):
            code, out, err = await loadtest(url, "--callers", "2", "--processes", "2", "--wav", wav, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["settings"]["processes"] == 2
        callers = report["callers"]
        assert [c["caller"] for c in callers] == [0, 1]
        assert len({c["pid"] for c in callers}) == 2  # each in a process of its own
        assert all(c["failure"] is None and c["summary"]["answered"] == 1 for c in callers)
        assert (report["overall"]["answered"], report["overall"]["heard_ms"]["n"]) == (2, 2)

    run(main_())


@needs_espeak
def test_an_answer_longer_than_max_wait_is_waited_for_while_it_streams(wav: str) -> None:
    async def main_() -> None:
        async with server(max_sessions=1, max_answer_s=5.0) as (url, _):
            code, out, err = await loadtest(url, "--wav", wav, "--max-wait-s", "2", "--turns", "3", "--json")
        assert code == 0, err
        (caller,) = json.loads(out)["callers"]
        assert caller["failure"] is None and [t["status"] for t in caller["turns"]] == ["incomplete"] * 3
        # one that ended well after the 2 s wait, streaming all along (of three: the tiny model's answer ends
        # where its sampled speech codes do, and the end code now and then comes within a few frames)
        assert max(t["server"]["audio_s"] for t in caller["turns"]) >= 4

    run(main_())


def test_a_client_process_that_fails_outside_its_callers_is_reported_not_waited_for() -> None:
    broken = ("http://127.0.0.1:9", None, [], None, {})  # no settings: each process fails before any caller
    with pytest.raises(client_loadtest.ClientProcessError, match="AttributeError"):
        client_loadtest._in_processes([[0], [1]], broken, ())


def test_bad_arguments_are_refused_before_calling() -> None:
    # (the CLI as a process: in this one, Playwright's browser tests may have left an event loop running)
    for args, message in ((["--callers", "0"], "--callers must be between 1 and 256"),
                          (["--wav", "/nonexistent.wav"], "nonexistent.wav"),
                          (["--callers", "2", "--processes", "3"], "--processes must be between 1 and --callers")):
        done = subprocess.run([sys.executable, "-m", "rtc_agent.cli", "loadtest", "http://127.0.0.1:9", *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
