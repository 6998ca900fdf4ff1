"""What the caller's turn ends with, in words: Moonshine base (English speech recognition, MIT), for semantic_vad.

Smart Turn (end_of_turn.py) hears how a turn ends but not what was said, and on its own it cannot tell "What is
the weather like in Paris today?" from "I would like to book a table for" when both stop with the same fall: in
docs/TURN_TAKING.md it ends about half of the mid-sentence pauses within 200 ms and leaves a third of the
finished questions waiting a second or more. A turn whose last word is a conjunction, an article, a preposition
or an auxiliary is not over, whatever the voice does; one that ends on any other word usually is.

The model files ship in the moonshine-cpp wheel (MIT, a dependency of the project for those files alone: its C++
library is never loaded). They are in ONNX Runtime's ORT format with int8 weights that the graph turns into floats
with a Cast and a Mul on every run, 41 M weights per decoder step: 32 ms a token on this project's 2-core CI
machine. onnxruntime can load that file and save it as an ONNX model (the If node's two branches then need the
names the ONNX format requires, set here with the `onnx` package); loaded as ONNX, the graph's constant folding
turns the weights into floats once, at start-up, and a token takes 5-7 ms: a 2 s question is transcribed in
55-90 ms on one thread. The vocabulary is the wheel's tokenizer.bin: each token's bytes after a one-byte length.
"""
from __future__ import annotations

import functools
import importlib.util
import re
import tempfile
import threading
from pathlib import Path

import numpy as np

RATE = 16_000
MODEL_DIR = ("models", "base-en")  # inside the moonshine_cpp package
INSTALL_HINT = "pip install moonshine-cpp==0.1.4 onnx (dependencies of rtc-agent: the wheel carries the model)"
LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 52  # Moonshine base's decoder
START, END = 1, 2  # token ids
MAX_S = 8  # the turn's last 8 s, as the end-of-turn model
TOKENS_PER_S = 8  # generous for speech (about 3 words a second); a bound against a decoder that never stops
SPACE = "\u2581"  # the vocabulary's word boundary

# Words after which an English sentence does not end: articles and possessive determiners, conjunctions, the
# prepositions that are not also verb particles, the copula and contractions that need a complement, and
# hesitations. Left out, because sentences end with them too: pronouns and demonstratives ("Can you do that?"),
# auxiliaries ("Yes, I can."), question words ("Tell me when."), and the prepositions that are verb particles or
# adverbs ("Turn it on.", "I've seen it before."). A stranded preposition ends some questions ("Where are you
# from?"): such a question waits for the late verdicts, as it did before the words were heard.
UNFINISHED_WORDS = frozenset("""
a an the my your our their its every
and or but nor because although unless whether whereas than if
to of for with from at by into onto about between among during without within against toward towards upon via per
near
is are was were am be been being i'm we're you're they're he's she's it's there's let's
um uh er erm uhm
""".split())


class LastWordsUnavailable(RuntimeError):
    """The Moonshine model files (from the moonshine-cpp wheel) or the onnx package are not installed."""


def model_dir() -> Path:
    spec = importlib.util.find_spec("moonshine_cpp")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*MODEL_DIR)
        if (path / "decoder_model_merged.ort").is_file():
            return path
    raise LastWordsUnavailable(f"the last-words check needs the Moonshine model: {INSTALL_HINT}")


def unfinished(text: str) -> bool:
    """Whether a transcript ends where a sentence cannot: on a word of UNFINISHED_WORDS, a comma or a dash."""
    text = text.strip()
    if not text:
        return False  # nothing recognised: no evidence either way
    if text[-1] in ",;:-\u2014\u2013":
        return True
    words = re.findall(r"[a-z']+", text.lower())
    return bool(words) and words[-1] in UNFINISHED_WORDS


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
    """The ORT-format model at `path` as ONNX bytes (see the module's docstring for why)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no machine-specific ops
        options.optimized_model_filepath = str(Path(folder) / "model.onnx")
        ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        model = onnx.load(options.optimized_model_filepath)

    def name_branches(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    attribute.g.name = attribute.g.name or f"{node.name or node.op_type}_{attribute.name}"
                    name_branches(attribute.g)

    name_branches(model.graph)
    return model.SerializeToString()


_lock = threading.Lock()


@functools.cache
def _load_shared() -> Transcriber:
    return Transcriber()


def shared_transcriber() -> Transcriber:
    """The process's recogniser, loaded on first use (a second or two; call it off the event loop)."""
    with _lock:
        return _load_shared()


def installed() -> bool:
    try:
        model_dir()
        import onnx  # noqa: F401
    except (LastWordsUnavailable, ImportError):
        return False
    return True
