"""How a transcript ends (media/sentence_end.py): what semantic_vad reads beside Smart Turn at a pause."""
from __future__ import annotations

import pytest

from rtc_agent.media.sentence_end import Ending, ending


@pytest.mark.parametrize("text", [
    "Tell me a short joke about penguins.", "Thank you.", "Turn up the heating in the back seats, please.", "Stop!",
    'He said "yes."',
])
def test_a_sentence_that_ends_is_finished(text: str) -> None:
    assert ending(text) is Ending.FINISHED


@pytest.mark.parametrize("text", [
    "What is the population of Canada?", "Why is the sky blue?", "Do you know what time it is?", "What is that?",
    "Can you wake me up at seven?",  # a number ends a question
])
def test_a_question_that_ends_is_a_question(text: str) -> None:
    assert ending(text) is Ending.QUESTION


@pytest.mark.parametrize("text", [
    "I would like to book a table for",  # no sentence punctuation
    "I am trying to find a recipe that uses",
    "Can you navigate to.",  # the recogniser's full stop on a sentence cut in its pause: the word decides
    "We could get home to.", "I forgot to tell you that.", "Can you check whether.", "Please add eggs and.",
    "Could you check if the.", "Send it to my.", "The problem is.", "I would like a table for four.",
    "Set an alarm for seven thirty.",  # a number may go on ("…thirty five")
    "So I was thinking um.", "Maybe we could...", "Hello, can you", "Let me know when.",
    "Could you find out if?", "Can you find me a recipe for?",  # the recogniser's question mark on a cut question
    "Turn up the heating in the back seats,",  # a comma: the sentence goes on
])
def test_a_sentence_still_being_said_is_unfinished(text: str) -> None:
    assert ending(text) is Ending.UNFINISHED


@pytest.mark.parametrize("text", ["", "  ", "...", "Hello.", "Hi.", "Okay.", "So.", "Yes.", "Well, hello."])
def test_no_words_or_an_opener_alone_is_no_evidence(text: str) -> None:
    assert ending(text) is Ending.UNKNOWN
