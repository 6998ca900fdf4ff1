"""What the caller's turn ends with, in words, for semantic_vad: Moonshine base's transcript (English speech
recognition, MIT) and a trigram language model's P(a sentence ends after these words) (CMU Sphinx's en-us model).

Smart Turn (end_of_turn.py) hears how a turn ends but not what was said, and on its own it cannot tell "What is
the weather like in Paris today?" from "I would like to book a table for" when both stop with the same fall: in
docs/TURN_TAKING.md it ends about half of the mid-sentence pauses within 200 ms and leaves a third of the
finished questions waiting a second or more. A language model knows that a sentence rarely ends after "a table
for" (P 0.016) and often after "Paris today" (0.34), and that "Where are you from" may end (0.24).

Moonshine's model files ship in the moonshine-cpp wheel (MIT; the `last-words` extra installs it for those files
alone: its C++ library is never loaded). They are in ONNX Runtime's ORT format with int8 weights that the graph
turns into floats with a Cast, a Mul and an Add on every run, 41 M weights per decoder step: 32 ms a token on this
project's 2-core CI machine. onnxruntime can load that file and save it as an ONNX model; here (with the `onnx`
package) the weights are then made floats once and the If node's two branches get the names the ONNX format
requires, and a token takes 5-7 ms: a 2 s question is transcribed in 55-100 ms on one thread, for about 650 MB of
memory. The vocabulary is the wheel's tokenizer.bin: each token's bytes after a one-byte length.

Off by default (the server's --last-words): docs/TURN_TAKING.md, fifteenth session, says why.

The language model is the trigram model (en-us.lm.bin, 27 MB) that the pocketsphinx wheel (BSD-2) ships and reads;
nothing else of pocketsphinx is used.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16_000
MODEL_DIR = ("models", "base-en")  # inside the moonshine_cpp package
INSTALL_HINT = ("pip install 'rtc-agent[last-words]' (moonshine-cpp and pocketsphinx: their wheels carry "
                "the models)")
LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 52  # Moonshine base's decoder
START, END = 1, 2  # token ids
MAX_S = 8  # the turn's last 8 s, as the end-of-turn model
TOKENS_PER_S = 8  # generous for speech (about 3 words a second); a bound against a decoder that never stops
SPACE = "\u2581"  # the vocabulary's word boundary

# Below this P(the sentence ends here | the last two words) a turn's words are unfinished (chosen on the tuning sets
# with scripts/turn_tuning.py --search; docs/TURN_TAKING.md)
UNFINISHED_BELOW = 0.08
LOG_BASE = math.log(1.0001)  # pocketsphinx's log scale: its probabilities are log base 1.0001
SENTENCE_END = "</s>"


class LastWordsUnavailable(RuntimeError):
    """The Moonshine model files (from the moonshine-cpp wheel), onnx or pocketsphinx are not installed."""


def model_dir() -> Path:
    spec = importlib.util.find_spec("moonshine_cpp")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*MODEL_DIR)
        if (path / "decoder_model_merged.ort").is_file():
            return path
    raise LastWordsUnavailable(f"the last-words check needs the Moonshine model: {INSTALL_HINT}")


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


class Transcriber:
    """Moonshine base: 16 kHz mono float32 -> text. Thread-safe (onnxruntime sessions run concurrently; the rest
    is local), one thread per call."""

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime as ort

        path = path or model_dir()
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._encoder = ort.InferenceSession(_as_onnx(path / "encoder_model.ort"), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self._decoder = ort.InferenceSession(_as_onnx(path / "decoder_model_merged.ort"), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self._vocabulary = _vocabulary(path / "tokenizer.bin")

    def __call__(self, audio: np.ndarray) -> str:
        audio = np.asarray(audio, np.float32)[-RATE * MAX_S:]
        if len(audio) < RATE // 10:
            return ""
        (hidden,) = self._encoder.run(None, {"input_values": audio[None]})
        empty = np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32)
        cache = {f"past_key_values.{layer}.{side}.{kind}": empty
                 for layer in range(LAYERS) for side in ("decoder", "encoder") for kind in ("key", "value")}
        tokens, token = [], START
        for step in range(int(len(audio) / RATE * TOKENS_PER_S) + 4):
            logits, *present = self._decoder.run(None, {
                "input_ids": np.array([[token]], np.int64), "encoder_hidden_states": hidden,
                "use_cache_branch": np.array([step > 0]), **cache})
            token = int(logits[0, -1].argmax())
            if token == END:
                break
            tokens.append(token)
            for name, value in zip(cache, present):  # the encoder's keys and values are made by the first step
                if step == 0 or ".decoder." in name:
                    cache[name] = value
        return self._text(tokens)

    def _text(self, tokens: list[int]) -> str:
        data = b"".join(self._vocabulary[t] for t in tokens if END < t < len(self._vocabulary))
        return data.decode("utf-8", errors="replace").replace(SPACE, " ").strip()


def _vocabulary(path: Path) -> list[bytes]:
    data, tokens, i = path.read_bytes(), [], 0
    while i < len(data):
        tokens.append(data[i + 1:i + 1 + data[i]])
        i += 1 + data[i]
    return tokens


def _as_onnx(path: Path) -> bytes:
    """The ORT-format model at `path` as ONNX bytes, its int8 weights made floats once (see the module's
    docstring for why)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no machine-specific ops
        options.optimized_model_filepath = str(Path(folder) / "model.onnx")
        ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        model = onnx.load(options.optimized_model_filepath)
    _dequantize_weights(model.graph)
    _name_branches(model.graph)
    return model.SerializeToString()


def _dequantize_weights(graph: "onnx.GraphProto") -> None:
    """Each weight stored as int8 and made a float by Cast -> Mul(scale) -> Add(offset) becomes that float
    weight. onnxruntime's own constant folding would do it too, but it keeps the int8 and the float copies and
    more: 560 MB for the decoder instead of 170."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    dropped_nodes, dropped_weights, weights = set(), set(), []
    for cast in graph.node:
        if cast.op_type != "Cast" or cast.input[0] not in initializers:
            continue
        last, used = cast, [cast.input[0]]
        value = numpy_helper.to_array(initializers[cast.input[0]]).astype(np.float32)
        for op in ("Mul", "Add"):
            users = consumers.get(last.output[0], [])
            if len(users) != 1 or users[0].op_type != op:
                break
            other = [name for name in users[0].input if name != last.output[0]]
            if len(other) != 1 or other[0] not in initializers:
                break
            operand = numpy_helper.to_array(initializers[other[0]]).astype(np.float32)
            value = value * operand if op == "Mul" else value + operand
            dropped_nodes.add(id(last))
            last = users[0]
            used.append(other[0])
        dropped_nodes.add(id(last))
        dropped_weights.update(used)
        weights.append(numpy_helper.from_array(value, last.output[0]))
    kept = [node for node in graph.node if id(node) not in dropped_nodes]
    del graph.node[:]
    graph.node.extend(kept)
    still_used = {name for node in kept for name in node.input}
    kept_weights = [t for t in graph.initializer if t.name not in dropped_weights or t.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(kept_weights + weights)


def _name_branches(graph: "onnx.GraphProto") -> None:
    """ONNX requires every graph to have a name; the saved If node's branches have none."""
    import onnx

    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                attribute.g.name = attribute.g.name or f"{node.name or node.op_type}_{attribute.name}"
                _name_branches(attribute.g)


_lock = threading.Lock()


class LastWords:
    """The recogniser and the language model together: a turn's audio -> (its words, P(a sentence ends there))."""

    def __init__(self) -> None:
        self.transcribe, self.sentence_ends = Transcriber(), SentenceEnds()

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
        model_dir()
        import onnx  # noqa: F401
        import pocketsphinx  # noqa: F401
    except (LastWordsUnavailable, ImportError):
        return False
    return True
