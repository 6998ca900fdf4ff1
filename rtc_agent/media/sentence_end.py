"""How a transcript of the caller's speech so far ends: a finished sentence, one still being said, or no evidence.

semantic_vad reads it beside Smart Turn's P(complete) (end_of_turn.py): Smart Turn hears how the speech falls
but not what was said, and cannot tell "What is the population of Canada?" from "I would like to book a table
for" when both stop with the same fall. The recogniser (moonshine.py, the captions' transcript) writes sentence
punctuation where it hears an end, but on a sentence cut in a pause it often writes one anyway ("navigate to.",
"…get home to."), so the last word's class overrides a final full stop: English sentences rarely end on an
article, a conjunction, a preposition, an auxiliary, a possessive or a filler, and a number may still be said
("at seven" may go on "…thirty").
"""
from __future__ import annotations

import enum
import re


class Ending(enum.Enum):
    QUESTION = "question"  # a question mark after a word that can end a question
    FINISHED = "finished"  # a full stop or an exclamation mark after a word that can end a sentence
    UNFINISHED = "unfinished"  # no sentence punctuation, or a last word that does not end a sentence
    UNKNOWN = "unknown"  # no words, or only a greeting or a discourse marker ("Hello.", "So."): no evidence


# Words an English sentence does not end on, whatever the punctuation after them.
_ARTICLES = "a an the"
_CONJUNCTIONS = "and or but nor because although though whereas unless than if whether while until"
_POSSESSIVES = "my your his her its our their every each"
_FILLERS = "um uh er erm hmm"
# Prepositions too, though a question may end on one ("Where does this train go to?"): the recogniser writes a
# question mark after a question cut in its pause ("Can you find me a recipe for?", "Could you remind me to?").
_PREPOSITIONS = ("to for of from in on at by into onto with without about between among through during before "
                 "after under over against toward towards across behind near like")
NEVER_AN_END = frozenset(" ".join((_ARTICLES, _CONJUNCTIONS, _POSSESSIVES, _FILLERS, _PREPOSITIONS)).split())
# Words a statement does not end on, though a question may ("Do you know what time it is?", "What is that?",
# "Since when?", "Can you wake me up at seven?"): after them only a question mark is an end.
_AUXILIARIES = "is are was were be been am do does did have has had will would shall should can could may might must"
_PRONOUNS = "i we they he she who that this these which what when where how why so"
QUESTION_END_ONLY = frozenset(" ".join((_AUXILIARIES, _PRONOUNS)).split())
_NUMBERS = frozenset(("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                      "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
                      "hundred thousand million").split())  # a number may go on: "at seven" (…thirty)
# A turn of these alone says nothing about whether the caller goes on ("Hello, can you hear me?" is "Hello." at
# its comma).
_OPENERS = frozenset("hello hi hey okay ok so well right yes yeah no now listen sorry please thanks".split())
_WORD = re.compile(r"[a-z0-9']+")
_SENTENCE_END = re.compile(r"(?<!\.\.)[.?!][\"')\]]*$")  # (an ellipsis is the recogniser's "goes on")


def ending(text: str) -> Ending:
    """How `text` (a transcript with the recogniser's punctuation) ends."""
    words = _WORD.findall(text.lower().replace("-", " "))
    if not words or all(w in _OPENERS for w in words):
        return Ending.UNKNOWN
    end = _SENTENCE_END.search(text.rstrip())
    last = words[-1]
    if end is None or last in NEVER_AN_END:
        return Ending.UNFINISHED
    if (last in QUESTION_END_ONLY or _is_number(last)) and "?" not in end.group():
        return Ending.UNFINISHED
    return Ending.QUESTION if "?" in end.group() else Ending.FINISHED


def _is_number(word: str) -> bool:
    """A number that may be followed by more of it: "twenty" (…five), "seven" (…thirty), "1" (…5)."""
    return word in _NUMBERS or word.isdigit()
