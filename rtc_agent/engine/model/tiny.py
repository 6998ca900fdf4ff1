"""The built-in tiny model: the released Qwen3-Omni architecture and token ids at tiny widths.

Its config is `models/tiny.json` laid over the released config (`models/qwen3-omni-30b-a3b-instruct.json`).
Weights are random with a fixed seed, so it babbles: it is a stand-in for trying the system without the 70 GB
checkpoint, not a model that understands anything. Its last Code2Wav convolution is scaled up so that the babble
is audible (about -25 dBFS RMS instead of -53). The tokenizer is byte-level and built offline, with the special
tokens at their real ids. It is saved once to a cache directory and then loaded through the same `from_pretrained`
path as a real checkpoint.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ...package_data import MODELS_DIR

RELEASED_CONFIG = MODELS_DIR / "qwen3-omni-30b-a3b-instruct.json"
TINY_OVERRIDES = MODELS_DIR / "tiny.json"
TINY_WEIGHT_SCALE = 0.1
# Gain on the waveform: the last Code2Wav convolution (no bias) times 25 = +28 dB, from -53 to about -25 dBFS RMS
# (peaks about -9 dBFS, no clipping); with ±0.1 weights throughout, the random babble is quieter than room noise.
TINY_OUTPUT_GAIN = 25.0

log = logging.getLogger(__name__)

# Names of the special tokens, keyed by the names used in the released config's `special_token_ids`.
SPECIAL_TOKEN_NAMES = {
    "im_start": "<|im_start|>", "im_end": "<|im_end|>", "audio": "<|audio_pad|>",
    "audio_start": "<|audio_start|>", "audio_end": "<|audio_end|>", "image": "<|image_pad|>",
    "video": "<|video_pad|>", "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
    "tts_pad": "<|tts_pad|>", "tts_bos": "<|tts_bos|>", "tts_eos": "<|tts_eos|>",
}
ENDOFTEXT_ID = 151643  # first special id of the Qwen vocabulary: regular tokens are the ids below it
# Added tokens of the Qwen3 vocabulary that are not special (they appear in text, as in the chat template's tools)
TOOL_TOKENS = {151657: "<tool_call>", 151658: "</tool_call>", 151665: "<tool_response>", 151666: "</tool_response>"}


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def released_reference() -> dict[str, Any]:
    return json.loads(RELEASED_CONFIG.read_text())


def released_config_dict() -> dict[str, Any]:
    return released_reference()["config"]


def tiny_config_dict() -> dict[str, Any]:
    return _merge(released_config_dict(), json.loads(TINY_OVERRIDES.read_text())["config"])


def _bytes_to_unicode() -> list[tuple[int, str]]:
    """GPT-2's byte-level alphabet, in its vocabulary order (so that "\\n" lands on id 198 as in Qwen)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return [(b, chr(c)) for b, c in zip(printable, chars)]


def _pseudo_words(count: int) -> list[str]:
    """Filler tokens for the regular ids a byte-level vocab does not use, so that any id decodes to a readable
    word-like string (the random model emits ids from the whole vocabulary)."""
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words: list[str] = []
    frontier = [""]
    while len(words) < count:
        frontier = [w + c for w in frontier for c in letters]
        words.extend("Ġ" + w for w in frontier if len(w) >= 2)
    return words[:count]


def build_tokenizer(reference: dict[str, Any]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = reference["special_token_ids"]
    vocab = {char: i for i, (_, char) in enumerate(_bytes_to_unicode())}
    named_regular = {ids["user"]: "user", ids["assistant"]: "assistant", ids["system"]: "system"}
    free = [i for i in range(len(vocab), ENDOFTEXT_ID) if i not in named_regular]
    vocab.update({word: i for word, i in zip(_pseudo_words(len(free)), free)})
    vocab.update({word: i for i, word in named_regular.items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = {ENDOFTEXT_ID: "<|endoftext|>"} | {ids[key]: name for key, name in SPECIAL_TOKEN_NAMES.items()}
    for token_id, name in sorted((specials | TOOL_TOKENS).items()):
        # Added tokens take the next free id: fill the gaps so that each special token lands on its real id.
        while (size := backend.get_vocab_size(with_added_tokens=True)) < token_id:
            backend.add_special_tokens([f"<|reserved_{size}|>"])
        backend.add_tokens([AddedToken(name, special=token_id in specials, normalized=False)])
        assert backend.token_to_id(name) == token_id, (name, token_id)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _cache_root() -> Path:
    return Path(os.environ.get("RTC_AGENT_CACHE", Path.home() / ".cache" / "rtc-agent"))


def tiny_checkpoint_dir() -> Path:
    """Return the saved tiny checkpoint, building it the first time (a few seconds)."""
    import transformers

    key = hashlib.sha256(
        RELEASED_CONFIG.read_bytes() + TINY_OVERRIDES.read_bytes() + Path(__file__).read_bytes()
        + transformers.__version__.encode()
    ).hexdigest()[:12]
    path = _cache_root() / f"tiny-{key}"
    if (path / "config.json").exists():
        return path
    log.info("building the built-in tiny model in %s", path)
    save_tiny_checkpoint(path)
    return path


def save_tiny_checkpoint(path: Path) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    from .weights import fill_random

    reference = released_reference()
    seed = json.loads(TINY_OVERRIDES.read_text())["seed"]
    config = Qwen3OmniMoeConfig(**tiny_config_dict())
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    fill_random(model, seed=seed, scale=TINY_WEIGHT_SCALE)
    with torch.no_grad():
        model.code2wav.decoder[-1].conv.weight.mul_(TINY_OUTPUT_GAIN)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    build_tokenizer(reference).save_pretrained(tmp)
    WhisperFeatureExtractor(feature_size=config.thinker_config.audio_config.num_mel_bins).save_pretrained(tmp)
    tmp.rename(path)  # atomic: a half-written checkpoint is never picked up
