"""Captions under bad input: a caller who vanishes mid-sentence, and noise instead of speech. The server logs no
error, frees the call, and the next caller's words are captioned."""
from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from adversary import active_calls, still_answers
from rtc_agent.client.microphone import RATE
from rtc_support import caller, needs_espeak, run, server, speech
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
COMPLETED = "conversation.item.input_audio_transcription.completed"


def test_a_caller_gone_mid_sentence_and_a_caller_of_noise_leave_nothing_behind(caplog: pytest.LogCaptureFixture
                                                                              ) -> None:
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        async with server(resume_window_s=0) as (url, app):
            async with caller(url) as (call, mic):
                sentence = speech("I would like to tell you a long story about my holiday in Portugal last year.")
                mic.play(sentence[:len(sentence) // 2])
                await call.next_event("input_audio_buffer.speech_started", timeout_s=20)
                await asyncio.sleep(0.5)
                await call.pc.close()  # gone without a word, mid-sentence
            async with caller(url) as (call, mic):
                noise = (np.random.default_rng(0).standard_normal(3 * RATE) * 0.2).astype(np.float32)
                mic.play(np.concatenate([noise, np.zeros(RATE, np.float32)]))
                await asyncio.sleep(5.0)  # (silero may or may not take the noise for speech: either is fine)
                assert all(isinstance(m["transcript"], str) for m in call.events_of(COMPLETED))
            for _ in range(100):
                if active_calls(app) == 0:
                    break
                await asyncio.sleep(0.1)
            assert active_calls(app) == 0
            async with caller(url) as (call, mic):
                mic.play(speech("Hello, how are you?"))
                caption = await call.next_event(COMPLETED, timeout_s=30)
                assert "hello" in caption["transcript"].lower(), caption  # (its first part: "Hello.")
            await still_answers(url, app)

    run(main(), timeout_s=200)
    problems = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]
