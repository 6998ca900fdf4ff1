"""semantic_vad's last-words check: Moonshine's transcript of real espeak-ng speech, the language model's
P(a sentence ends here), and how the words change what an early verdict may do."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rtc_agent.config import build_settings
from rtc_agent.media.end_of_turn import EAGERNESS, EndOfTurnScorer, SemanticTurn
from rtc_agent.media.last_words import shared_last_words, unfinished

from test_end_of_turn import gap, ssml_speech
from rtc_support import needs_espeak, run

RATE = 16_000


@pytest.mark.parametrize("text, expected", [
    ("What is the weather like in Paris today?", False),
    ("Hello, how are you?", False),
    ("Where are you from?", False),  # a stranded preposition may end a question
    ("Thank you very much.", False),
    ("I would like to book a table for.", True),  # the recogniser puts a full stop on a cut sentence too
    ("Please add eggs and", True),
    ("The best thing about living here is", True),
    ("Can you tell me how to get to", True),
    ("", None),  # nothing heard: no evidence either way
    ("Qqxzunknownzxqq", None),  # a last word the model does not know: no evidence
    ("Which team won the cup in 1998?", None),  # a number too (not "in", the word before it)
])
def test_the_language_model_knows_where_sentences_end(text: str, expected: bool | None) -> None:
    assert unfinished(shared_last_words().sentence_ends(text)) is expected


@needs_espeak
def test_moonshine_hears_a_whole_question_and_a_sentence_cut_in_its_pause() -> None:
    transcribe = shared_last_words().transcribe
    paused = ssml_speech("I would like to book a table for", 900, "four people tonight.", RATE)
    start, _ = gap(paused, RATE)
    cut = transcribe(paused[:start + RATE // 10])
    whole = transcribe(ssml_speech("What is the weather like in Paris", 0, "today?", RATE))
    hear = shared_last_words().sentence_ends
    assert "table for" in cut.lower() and unfinished(hear(cut)), cut
    assert "weather" in whole.lower() and "paris" in whole.lower() and unfinished(hear(whole)) is False, whole
    assert transcribe(np.zeros(RATE, np.float32)) in ("", ".")  # silence: no words made up


def test_the_last_words_are_heard_only_where_the_server_asks_for_them() -> None:
    from rtc_agent.media.end_of_turn import shared_scorer

    assert not shared_scorer().hears_words and shared_scorer(words=True).hears_words
    assert build_settings({}, env={}).last_words is False
    assert build_settings({}, env={"RTC_AGENT_LAST_WORDS": "1"}).last_words is True


def test_the_recogniser_runs_on_float_weights_made_once() -> None:
    import onnx

    from rtc_agent.media.moonshine import as_onnx as _as_onnx, model_dir

    graph = onnx.load_from_string(_as_onnx(model_dir() / "decoder_model_merged.ort")).graph
    weights = {t.name: t for t in graph.initializer}
    assert not [n for n in graph.node if n.op_type == "Cast" and n.input[0] in weights]  # no int8 -> float per run
    assert not [t for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]


def test_unfinished_words_hold_the_early_verdicts_and_finished_ones_lower_their_threshold() -> None:
    auto = EAGERNESS["auto"]
    assert auto.finished_threshold is not None and auto.finished_threshold < auto.threshold
    assert not auto.ends_turn([0.99], 64, unfinished=True)  # the words say more is coming
    assert auto.ends_turn([0.99], 64, unfinished=None)  # no recogniser: as before
    p = (auto.finished_threshold + auto.threshold) / 2
    assert auto.ends_turn([p], 64, unfinished=False) and not auto.ends_turn([p], 64, unfinished=None)
    assert auto.ends_turn([0.6], auto.patient_ms, unfinished=True)  # the late verdicts do not listen to the words


class _Fixed:
    """An end-of-turn model that always says `p` (the words come from the real recogniser)."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, audio: np.ndarray, threads: int = 1) -> float:
        return self.p


@needs_espeak
def test_a_pause_after_for_is_not_ended_by_a_confident_model_but_a_finished_question_is() -> None:
    paused = ssml_speech("I would like to book a table for", 900, "four people tonight.", RATE)
    start, _ = gap(paused, RATE)
    question = ssml_speech("What is the weather like in Paris", 0, "today?", RATE)
    end = int(np.flatnonzero(np.abs(question) > 0.01)[-1])
    scorer = EndOfTurnScorer(_Fixed(0.99), shared_last_words())

    async def ended(audio: np.ndarray) -> tuple[bool, str]:
        done = asyncio.Event()
        turn = SemanticTurn(scorer, EAGERNESS["auto"], done.set)
        turn.start([audio])
        for silence_ms in range(32, 800, 32):  # the early checks, then well short of the late ones
            turn.silence(silence_ms)
            await asyncio.sleep(0.05)
            if done.is_set():
                break
        turn.close()
        return done.is_set(), turn.words.text if turn.words else ""

    held, cut_words = run(ended(paused[:start]))
    answered, question_words = run(ended(question[:end]))
    assert not held and "for" in cut_words.lower(), cut_words
    assert answered and "paris" in question_words.lower(), question_words
