"""The memory guard and out-of-memory errors, on the CPU, through the real server, tiny model and aiortc callers.

The GPU's memory counter is the one thing stood in for: the server is given a reader that reports a chosen fill
level (on a GPU, `Engine.memory()` reads torch.cuda; `studies/device_memory_guard.sh` runs the real thing). An
out-of-memory error is injected by making one real engine function raise torch's `OutOfMemoryError` once, the
exception CUDA raises; everything around it runs as in a call."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from rtc_support import (
    RecordingEngine,
    caller,
    metric,
    metrics_text,
    needs_espeak,
    restore_ice,  # noqa: F401  (autouse fixture)
    run,
    say,
    server,
    wait_ready,
)

from rtc_agent.client.camera import SyntheticCamera
from rtc_agent.client.microphone import Microphone
from rtc_agent.client.peer import Call, CallError
from rtc_agent.engine import MemoryUse
from rtc_agent.engine.step import answer, audio_input

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
GB = 10**9


class FillLevel:
    """Stands in for the GPU's memory counter: 80 GB, of which `pct` % are in use."""

    def __init__(self, pct: float) -> None:
        self.pct = pct

    def __call__(self) -> MemoryUse:
        return MemoryUse(used_bytes=round(self.pct * 0.8 * GB), total_bytes=80 * GB, peak_bytes=int(60 * GB))


async def capacity(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/capacity") as r:
            return r.status, await r.json()


def test_on_a_cpu_the_memory_gauges_are_zero() -> None:
    async def main() -> None:
        async with server() as (url, _):
            await wait_ready(url)
            text = await metrics_text(url)
        for name in ("gpu_memory_used_gb", "gpu_memory_total_gb", "gpu_memory_peak_gb"):
            assert f"\n{name} 0.0" in text, name
        assert metric(text, "rtc_agent_memory_guard_active") == 0

    run(main())


def test_above_the_guard_no_call_is_admitted_video_windows_shrink_and_the_calls_in_progress_go_on() -> None:
    async def main() -> None:
        fill, recorder = FillLevel(50.0), RecordingEngine()
        async with server(engine_=recorder, memory=fill, memory_guard_pct=90.0) as (url, _):
            await wait_ready(url)
            text = await metrics_text(url)
            assert metric(text, "gpu_memory_used_gb") == 40.0 and metric(text, "gpu_memory_total_gb") == 80.0
            assert metric(text, "gpu_memory_peak_gb") == 60.0
            mic = Microphone()
            call = Call(url)
            await call.connect(mic, SyntheticCamera(640, 480, fps=10))
            try:
                await say(call, mic)
                first = (await call.next_event("response.done", timeout_s=30))["response"]
                [session] = recorder.sessions
                assert session.video_stats()["window_s"] == 30

                fill.pct = 93.0  # past the guard: nobody new gets in
                with pytest.raises(CallError) as refused:
                    async with caller(url):
                        pass
                status, body = await capacity(url)
                text = await metrics_text(url)
                for _ in range(50):  # the guard's next round (every 0.5 s) shortens the video window
                    if session.video_stats()["window_s"] < 30:
                        break
                    await asyncio.sleep(0.1)
                window = session.video_stats()["window_s"]

                await say(call, mic, "And what about tomorrow?")  # the call in progress is still answered
                second = (await call.next_event("response.done", timeout_s=30))["response"]

                fill.pct = 60.0  # room again: calls are admitted
                async with caller(url) as (other, other_mic):
                    await other.next_event("session.created", timeout_s=10)
            finally:
                await call.hang_up()

        e = refused.value
        assert (e.status, e.code, e.reason, e.retry_after_s) == (503, "server_full", "memory", 10)
        assert "74.4 of 80.0 GB" in e.message and "90 %" in e.message
        assert status == 404 and body["status"] == "full" and body["reason"] == "memory"
        assert metric(text, 'rtc_agent_offers_rejected_total{reason="memory"}') == 1
        assert metric(text, "rtc_agent_memory_guard_active") == 1
        assert metric(text, "gpu_memory_used_gb") == pytest.approx(74.4)
        assert window == 15
        assert first["status"] == second["status"] == "incomplete" and second["metrics"]["frames_sent"] > 0
        assert [e for e in call.events_of("error")] == []

    run(main())


def test_out_of_memory_in_a_turn_or_an_answer_ends_it_with_an_error_and_the_call_goes_on(monkeypatch) -> None:
    armed = {"encode": False, "frames": False}

    def fail_once(name, real):
        def run_or_fail(*args, **kwargs):
            if armed[name]:
                armed[name] = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
            return real(*args, **kwargs)
        return run_or_fail

    monkeypatch.setattr(audio_input.AudioEncoder, "__call__",  # a prefill of the turn
                        fail_once("encode", audio_input.AudioEncoder.__call__))
    monkeypatch.setattr(answer, "_frames", fail_once("frames", answer._frames))  # a step of the answer loop

    async def main() -> None:
        async with server(max_answer_s=1.0) as (url, _), caller(url) as (call, mic):
            await call.next_event("session.created", timeout_s=10)
            armed["encode"] = True
            await say(call, mic)
            turn_error = await call.next_event("error", timeout_s=30)
            after_turn = (await call.next_event("response.done", timeout_s=30))["response"]

            armed["frames"] = True
            await say(call, mic, "And what about tomorrow?")
            answer_error = await call.next_event("error", timeout_s=30)
            failed = (await call.next_event("response.done", timeout_s=30))["response"]

            await say(call, mic, "Thank you, that is all for now.")
            last = (await call.next_event("response.done", timeout_s=30))["response"]

        for error in (turn_error, answer_error):
            assert error["error"]["code"] == "out_of_memory" and "call goes on" in error["error"]["message"]
        assert not armed["encode"] and not armed["frames"]
        # the rest of the caller's speech after the dropped piece was still a turn, and answered
        assert after_turn["status"] == "incomplete"
        assert failed["status"] == "failed"
        assert last["status"] == "incomplete" and last["metrics"]["frames_sent"] > 0

    run(main())
