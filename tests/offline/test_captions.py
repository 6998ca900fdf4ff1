"""The captions of the caller's words (media/captions.py) on the real recogniser (Moonshine base) and espeak-ng
speech: how a turn is cut into parts, what the deltas and the final transcript say, and the bounds on a
monologue, silence, noise and a dropped turn. Chunks go in as the conversation hands them over; the recogniser's
threads are waited for where a test needs their answer, so that nothing here depends on the machine's speed."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from rtc_agent.conversation_events import ConversationEvent
from rtc_agent.media import captions as captions_module
from rtc_agent.media.captions import MAX_PART_S, PART_PAUSE_MS, CaptionPool, Captions
from rtc_agent.media.moonshine import Moonshine, shared
from rtc_agent.media.vad import CHUNK_MS, CHUNK_SAMPLES

from rtc_support import needs_espeak, run, speech

RATE = 16_000
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
FAILED = "conversation.item.input_audio_transcription.failed"


class Recorder:
    """The events a Captions object says, in order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: ConversationEvent) -> None:
        self.events.append(event.as_json())

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def text(self, item_id: str) -> str:
        """The item's caption: its parts' completed transcripts in content_index order."""
        parts = sorted((e["content_index"], e["transcript"]) for e in self.of(COMPLETED) if e["item_id"] == item_id)
        return " ".join(t for _, t in parts)


def chunks_of(audio: np.ndarray) -> list[np.ndarray]:
    return [audio[i:i + CHUNK_SAMPLES] for i in range(0, len(audio) - CHUNK_SAMPLES + 1, CHUNK_SAMPLES)]


def loud(chunk: np.ndarray) -> bool:
    """Speech by energy (espeak-ng's silence is exact zeros), in place of the VAD."""
    return float(np.sqrt(np.mean(chunk ** 2))) > 0.003


async def settle(pool: CaptionPool) -> None:
    """Until the recogniser's threads have nothing left to do and their answers are in."""
    while pool.pending():
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)


async def speak(captions: Captions, pool: CaptionPool, audio: np.ndarray, item_id: str = "item_1",
                speaking: Any = loud, wait_every: int = 8) -> None:
    """A turn of `audio`: begun, confirmed after 4 chunks, fed chunk by chunk (the threads waited for every
    `wait_every` chunks, as a machine with time to spare would have them), and ended."""
    chunks = chunks_of(audio)
    captions.begin(item_id, chunks[:1], lead_ms=0)
    for n, chunk in enumerate(chunks[1:], 1):
        if n == 4:
            captions.confirm()
        captions.add(chunk, speaking(chunk))
        if n % wait_every == 0:
            await settle(pool)
    captions.end()
    await settle(pool)


@pytest.fixture(scope="module")
def pool() -> Any:
    made = CaptionPool(shared(), threads=1)
    yield made
    made.close()


def words(text: str) -> list[str]:
    return [w.strip(".,?!").lower() for w in text.split()]


@needs_espeak
def test_a_question_gets_deltas_while_spoken_then_its_final_transcript(pool: CaptionPool) -> None:
    said = Recorder()

    async def main() -> None:
        captions = Captions(pool, said)
        audio = np.concatenate([speech("What time does the library open on Saturday?", RATE), np.zeros(RATE // 2,
                                                                                                         np.float32)])
        await speak(captions, pool, audio)

    run(main())
    assert said.of(DELTA), said.events
    assert said.events[-1]["type"] == COMPLETED and said.of(COMPLETED) == said.events[-1:]
    assert {e["item_id"] for e in said.events} == {"item_1"} and {e["content_index"] for e in said.events} == {0}
    provisional = "".join(e["delta"] for e in said.of(DELTA))
    final = said.text("item_1")
    assert {"library", "open", "saturday"} <= set(words(final)), final
    assert not provisional.startswith(" ") and set(words(provisional)) <= set(words(final)) | {"the", "a"}


@needs_espeak
def test_a_pause_ends_a_part_and_the_turn_goes_on_in_the_next(pool: CaptionPool) -> None:
    said = Recorder()
    pause = np.zeros(int(RATE * (PART_PAUSE_MS + 4 * CHUNK_MS) / 1000), np.float32)

    async def main() -> None:
        captions = Captions(pool, said)
        audio = np.concatenate([speech("I would like to book a table", RATE), pause,
                                speech("for four people tonight.", RATE)])
        await speak(captions, pool, audio)

    run(main())
    completed = said.of(COMPLETED)
    assert [e["content_index"] for e in completed] == [0, 1], said.events
    assert "table" in words(completed[0]["transcript"]) and "people" in words(completed[1]["transcript"])


@needs_espeak
def test_a_monologue_is_captioned_in_parts_of_bounded_length(pool: CaptionPool, monkeypatch: Any) -> None:
    """60 s of speech with no pause the VAD would hear (every chunk counts as speech): parts of at most
    MAX_PART_S, each transcribed, none of the recogniser's work on more than that."""
    lengths: list[int] = []
    recognise = pool.recognizer.words

    def measured(audio: np.ndarray, start: Any = (), stop: Any = None) -> list[str]:
        lengths.append(len(audio))
        return recognise(audio, start, stop)

    monkeypatch.setattr(pool, "recognizer", type("Measured", (), {"words": staticmethod(measured)})())
    said = Recorder()
    sentence = speech("The quick brown fox jumps over the lazy dog near the river bank.", RATE)
    monologue = np.tile(sentence, int(np.ceil(60 * RATE / len(sentence))))[:60 * RATE]

    async def main() -> None:
        await speak(Captions(pool, said), pool, monologue, speaking=lambda chunk: True, wait_every=32)

    run(main())
    completed = said.of(COMPLETED)
    assert len(completed) >= 60 / MAX_PART_S and max(lengths) <= MAX_PART_S * RATE, (len(completed), max(lengths))
    assert [e["content_index"] for e in completed] == list(range(len(completed)))
    assert sum(words(e["transcript"]).count("fox") for e in completed) >= 8, said.text("item_1")


def test_silence_and_noise_get_no_caption_and_a_dropped_turn_says_nothing_more(pool: CaptionPool) -> None:
    said = Recorder()
    rng = np.random.default_rng(1)

    async def main() -> None:
        captions = Captions(pool, said)
        await speak(captions, pool, np.zeros(3 * RATE, np.float32), speaking=lambda chunk: True)
        await speak(captions, pool, (rng.standard_normal(3 * RATE) * 0.05).astype(np.float32), item_id="item_2",
                    speaking=lambda chunk: True)
        captions.begin("item_3", chunks_of(np.zeros(RATE, np.float32)), lead_ms=0)
        captions.confirm()
        captions.drop()  # a false start, or input_audio_buffer.clear
        captions.add(np.zeros(CHUNK_SAMPLES, np.float32), True)
        await settle(pool)

    run(main())
    assert not [e for e in said.events if e.get("transcript") or e.get("delta")], said.events
    assert not said.of(FAILED) and not [e for e in said.events if e["item_id"] == "item_3"]


def test_a_recogniser_that_fails_says_so_for_that_part_and_the_next_turn_is_captioned() -> None:
    class Failing:
        name, languages = "failing", ("en",)
        calls = 0

        def words(self, audio: np.ndarray, start: Any = (), stop: Any = None) -> list[str]:
            Failing.calls += 1
            if Failing.calls == 1:
                raise RuntimeError("out of memory")
            return ["Hello."]

    said = Recorder()

    async def main() -> None:
        failing = CaptionPool(Failing(), threads=1)
        try:
            captions = Captions(failing, said)
            tone = (np.sin(np.arange(RATE) / 5) * 0.1).astype(np.float32)
            captions.begin("item_1", chunks_of(tone), lead_ms=0)
            captions.end()
            await settle(failing)
            await speak(captions, failing, tone, item_id="item_2", speaking=lambda chunk: True)
        finally:
            failing.close()

    run(main())
    assert said.events[0]["type"] == FAILED and said.events[0]["item_id"] == "item_1"
    assert "out of memory" in said.events[0]["error"]["message"]
    assert said.of(COMPLETED)[-1] == {"type": COMPLETED, "item_id": "item_2", "content_index": 0,
                                      "transcript": "Hello."}


@needs_espeak
def test_a_transcript_can_be_made_to_start_with_words_heard_before() -> None:
    recogniser: Moonshine = shared()
    audio = speech("Set a timer for ten minutes please.", RATE)
    free = recogniser.words(audio)
    forced = recogniser.words(audio, start=free[:3])
    assert forced[:3] == free[:3] and "minutes" in words(" ".join(forced)), (free, forced)
    assert recogniser.words(audio, start=["Zzyzx-never-written"])[:1] == free[:1]  # unknown words: not forced


def test_the_pool_runs_finals_before_provisionals() -> None:
    order: list[int] = []
    busy = threading.Event()

    class Blocking:
        """Holds its one thread on the first job until the others are queued."""

        name, languages = "blocking", ("en",)

        def words(self, audio: np.ndarray, start: Any = (), stop: Any = None) -> list[str]:
            if audio[0] == 0:
                busy.wait(10)
            order.append(int(audio[0]))
            return []

    async def main() -> None:
        blocking = CaptionPool(Blocking(), threads=1)
        try:
            for n, final in ((0, True), (1, False), (2, False), (3, True)):
                blocking.submit(captions_module.Job(np.full(4, n, np.float32), (), final, lambda w, e: None))
            busy.set()
            await settle(blocking)
        finally:
            blocking.close()

    run(main())
    assert order == [0, 3, 1, 2]


@needs_espeak
def test_a_part_of_a_turn_not_yet_speech_is_said_only_once_the_turn_counts(pool: CaptionPool) -> None:
    """A part that ends (a pause) before the turn is confirmed waits: a false start drops it unsaid, a
    confirmation (or a push-to-talk commit) lets it out."""
    said = Recorder()
    hello = chunks_of(np.concatenate([np.zeros(RATE // 10, np.float32),
                                      speech("Good morning, how are you today?", RATE),
                                      np.zeros(RATE // 2, np.float32)]))

    async def main() -> None:
        captions = Captions(pool, said)
        for item, confirm in (("item_dropped", False), ("item_confirmed", True)):
            captions.begin(item, hello[:1], lead_ms=0)
            for chunk in hello[1:]:
                captions.add(chunk, loud(chunk))
            await settle(pool)
            assert not said.events, said.events  # the part is over and transcribed, but not said
            if confirm:
                captions.confirm()
            else:
                captions.drop()
            await settle(pool)

    run(main())
    assert {e["item_id"] for e in said.events} == {"item_confirmed"}, said.events
    assert "morning" in words(said.text("item_confirmed")), said.events


def test_a_final_gives_up_the_provisional_being_made_and_runs_at_once() -> None:
    """The caller pauses while a provisional transcript of their words is being made: it is stopped (the
    recogniser sees `stop()` true), nothing it would have said goes out, and the final transcript comes."""
    provisional_running, stopped = threading.Event(), threading.Event()

    class Slow:
        name, languages = "slow", ("en",)

        def words(self, audio: np.ndarray, start: Any = (), stop: Any = None) -> list[str]:
            if len(audio) < int(0.9 * RATE):  # the provisional (0.64 s of audio): until it is told to stop
                provisional_running.set()
                for _ in range(1000):
                    if stop():
                        stopped.set()
                        break
                    time.sleep(0.01)
                return ["Wrong", "words", "here"]
            return ["Hello", "there."]

    said = Recorder()

    async def main() -> None:
        slow = CaptionPool(Slow(), threads=1)
        try:
            captions = Captions(slow, said)
            tone = (np.sin(np.arange(RATE) / 5) * 0.1).astype(np.float32)
            chunks = chunks_of(tone)
            captions.begin("item_1", chunks[:1], lead_ms=0)
            captions.confirm()
            for chunk in chunks[1:]:
                captions.add(chunk, True)
            for _ in range(200):  # until the provisional is being made
                if provisional_running.is_set():
                    break
                await asyncio.sleep(0.01)
            for chunk in chunks_of(np.zeros(RATE // 2, np.float32)):
                captions.add(chunk, False)
            captions.end()
            await settle(slow)
        finally:
            slow.close()

    run(main())
    assert provisional_running.is_set() and stopped.is_set()
    assert not said.of(DELTA) and said.of(COMPLETED) == [{"type": COMPLETED, "item_id": "item_1",
                                                          "content_index": 0, "transcript": "Hello there."}]
