"""What the caller's turn ends with, in words, for semantic_vad: Moonshine base's transcript (English speech
recognition, MIT) and a trigram language model's P(a sentence ends after these words) (CMU Sphinx's en-us model).

Smart Turn (end_of_turn.py) hears how a turn ends but not what was said, and on its own it cannot tell "What is
the weather like in Paris today?" from "I would like to book a table for" when both stop with the same fall: in
docs/turn-taking.md it ends about half of the mid-sentence pauses within 200 ms and leaves a third of the
finished questions waiting a second or more. A language model knows that a sentence rarely ends after "a table
for" (P 0.016) and often after "Paris today" (0.34), and that "Where are you from" may end (0.24).

The recogniser is moonshine.py's, the one the captions use.

Off by default (the server's --last-words): on the recordings of people it changes little (finished P90
1251 ms, as without it) and cuts one or two more of their 19 pauses, and it costs about 650 MB and 2 s of start-up
a media process (docs/turn-taking.md, "The last words").

The language model is the trigram model (en-us.lm.bin, 27 MB) that the pocketsphinx wheel (BSD-2) ships and reads;
nothing else of pocketsphinx is used.
"""
from __future__ import annotations

import functools
import math
import re
import threading
from pathlib import Path

import numpy as np

from . import moonshine

INSTALL_HINT = ("pip install 'rtc-agent[last-words]' (pocketsphinx: its wheel carries the language model; the "
                "recogniser comes with rtc-agent)")

# Below this P(the sentence ends here | the last two words) a turn's words are unfinished (chosen on the tuning sets
# with studies/turn_tuning.py --search; docs/turn-taking.md)
UNFINISHED_BELOW = 0.08
LOG_BASE = math.log(1.0001)  # pocketsphinx's log scale: its probabilities are log base 1.0001
SENTENCE_END = "</s>"


class LastWordsUnavailable(RuntimeError):
    """The Moonshine model files (from the moonshine-cpp wheel), onnx or pocketsphinx are not installed."""


class SentenceEnds:
    """P(an English sentence ends after `text`), from its last two words; None when there are no words or the last
    one is not in the model's vocabulary (a name it does not know: no evidence). Thread-safe."""

    def __init__(self) -> None:
        import pocketsphinx

        pocketsphinx.set_loglevel("ERROR")
        path = Path(pocketsphinx.get_model_path()) / "en-us" / "en-us.lm.bin"
        self._model = pocketsphinx.NGramModel(None, pocketsphinx.LogMath(), str(path))
        self._unknown = self._model.prob(["qqxzunknownzxqq"])  # what a word the model does not know scores
        self._lock = threading.Lock()  # (the C model keeps a history buffer)

    def __call__(self, text: str) -> float | None:
        words = re.findall(r"[a-z0-9']+", text.lower().replace("-", ""))  # a number is a word it does not know
        if not words:
            return None
        with self._lock:
            if self._model.prob([words[-1]]) == self._unknown:
                return None
            return math.exp(self._model.prob([SENTENCE_END, *reversed(words[-2:])]) * LOG_BASE)


def unfinished(end_probability: float | None) -> bool | None:
    """Whether words with this P(the sentence ends here) are unfinished (None: no evidence)."""
    return None if end_probability is None else end_probability < UNFINISHED_BELOW


_lock = threading.Lock()


class LastWords:
    """The recogniser and the language model together: a turn's audio -> (its words, P(a sentence ends there))."""

    def __init__(self) -> None:
        self.transcribe, self.sentence_ends = moonshine.shared(), SentenceEnds()

    def __call__(self, audio: np.ndarray) -> tuple[str, float | None]:
        text = self.transcribe(audio)
        return text, self.sentence_ends(text)


@functools.cache
def _load_shared() -> LastWords:
    return LastWords()


def shared_last_words() -> LastWords:
    """The process's recogniser and language model, loaded on first use (a second or two; call it off the event
    loop)."""
    with _lock:
        return _load_shared()


def installed() -> bool:
    try:
        import pocketsphinx  # noqa: F401
    except ImportError:
        return False
    return moonshine.installed()
