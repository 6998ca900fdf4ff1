"""semantic_vad reading the caller's words (media/end_of_turn.py with media/captions.py and
media/sentence_end.py): on espeak-ng speech through silero, the real Moonshine recogniser and the real Smart Turn
model. Each chunk goes in as the conversation hands it over, and the recogniser and the model are waited for
after each one (a machine with time to spare), so that nothing here depends on the machine's speed."""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rtc_agent.config import TurnSettings
from rtc_agent.media.captions import CaptionPool, Captions, say_nothing
from rtc_agent.media.end_of_turn import EAGERNESS, SemanticTurn, shared_scorer
from rtc_agent.media.moonshine import shared
from rtc_agent.media.vad import CHUNK_MS, CHUNK_SAMPLES, SpeechProbability, TurnDetector

from rtc_support import needs_espeak, run, speech

pytestmark = [needs_espeak, pytest.mark.timeout(240)]
RATE = 16_000
AUTO = EAGERNESS["auto"]
# A sentence cut where people pause, whose fall Smart Turn hears as an end (P 0.95 at auto's first check).
UNFINISHED = "Could you find out if"
# A finished question that Smart Turn alone leaves below 0.9 at its early checks (P 0.26).
FINISHED = "Can you tell me a joke about penguins?"


async def turn(text: str, words: bool, silence_ms: int = AUTO.early_until_ms + 2 * CHUNK_MS) -> dict[str, Any]:
    """`text` said, then silence: the silence at which semantic_vad ended the turn (None: not in `silence_ms`),
    with the caller's words read (`words`) or Smart Turn alone, and the deciding verdict's P and words."""
    pool = CaptionPool(shared(), threads=1)
    captions = Captions(pool, say_nothing, deltas=False)
    ended: list[int] = []
    vad, settings = SpeechProbability(), TurnSettings()
    detector = TurnDetector(settings.vad_threshold, 10_000, settings.min_speech_ms)
    semantic = SemanticTurn(shared_scorer(), AUTO, lambda: ended.append(detector.silence_run_ms))
    semantic.captions = captions if words else None
    audio = np.concatenate([speech(text, RATE), np.zeros(RATE * silence_ms // 1000, np.float32)])
    chunks = [audio[i:i + CHUNK_SAMPLES] for i in range(0, len(audio) - CHUNK_SAMPLES + 1, CHUNK_SAMPLES)]
    try:
        begun = False
        for chunk in chunks:
            detector.feed(vad(chunk))
            if not begun:
                if not detector.active:
                    continue
                begun = True
                captions.begin("item_1", [chunk])
                captions.confirm()
                semantic.start([chunk])
                continue
            speaking = not detector.silence_run_ms
            captions.add(chunk, speaking)
            semantic.add([chunk])
            if detector.confirmed:
                semantic.silence(detector.silence_run_ms)
            while pool.pending() or semantic._tasks:  # the recogniser and the verdicts have their answers in
                await asyncio.sleep(0.01)
            if ended:
                break
    finally:
        semantic.close()
        captions.close()
        pool.close()
    heard = semantic.heard
    return {"ended_at_ms": ended[0] if ended else None, "p": semantic.probability,
            "words": heard.text if heard else None, "ready": heard.ready if heard else None}


def test_a_sentence_cut_after_if_is_held_though_smart_turn_alone_ends_it() -> None:
    alone, read = run(turn(UNFINISHED, words=False)), run(turn(UNFINISHED, words=True))
    assert alone["ended_at_ms"] is not None and alone["ended_at_ms"] < AUTO.early_until_ms, alone
    assert read["ended_at_ms"] is None, read  # held past every early check
    assert read["ready"] and read["words"].lower().rstrip(".?").endswith("if"), read


def test_a_finished_question_ends_at_an_early_check_where_smart_turn_alone_waits() -> None:
    alone, read = run(turn(FINISHED, words=False)), run(turn(FINISHED, words=True))
    assert alone["ended_at_ms"] is None, alone  # Smart Turn alone leaves it for the late checks
    assert read["ended_at_ms"] is not None and read["ended_at_ms"] < AUTO.early_until_ms, read
    assert read["ready"] and read["words"].rstrip().endswith("?"), read
