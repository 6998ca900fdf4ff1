"""The language lock: the Thinker's text held to one language's scripts by the token-mask path of function calls,
exact on byte-level vocabularies whose tokens may be fragments of UTF-8 characters; the system turn says so; an
unknown language is refused and changes nothing."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import regex
import torch
from engine_helpers import engine_for, run

from rtc_agent import language
from rtc_agent.engine import SessionOptions
from rtc_agent.engine.step.sampling import Sampling
from rtc_agent.engine.step.tools import TokenMasks, ToolRuntime

WIDE = Sampling(temperature=1.0, top_k=0, top_p=1.0)  # the random model's draws over the whole vocabulary

# A test vocabulary of several scripts: every byte, words and characters of five scripts, and tokens that are
# fragments of UTF-8 characters or straddle two (a Latin letter then the lead byte of a Han character, ...).
WORDS = ["hello", " world", "café", " Привет", "мир", "中文", "中", "好", "γεια", "مرحبا", "日本", "ひら",
         "한국", " ok", "!", "。", "，"]
FRAGMENTS = [b"\xe4\xb8", b"\xad", b"a\xe4", b"\xb8\xad!", b"\xd0", b"\x9f", b"\xc3", b"\xa9 ",
             b"\xe6\x96\x87x"]


def _test_vocabulary():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_char = {b: c for b, c in zip(range(256), _byte_chars())}
    assert set(to_char.values()) == set(alphabet)
    pieces = sorted({to_char[b] for b in range(256)}) + ["".join(to_char[b] for b in w.encode()) for w in WORDS] + \
        ["".join(to_char[b] for b in f) for f in FRAGMENTS]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(dict.fromkeys(pieces))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_end|>",)])
    backend.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>")]
    return tokenizer, ToolRuntime(tokenizer, len(tokenizer), *ids)


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _allowed(masks: TokenMasks, matcher, vocab: int) -> np.ndarray:
    host = torch.full((1, masks.words), -1, dtype=torch.int32)
    masks._fill(host, {0: matcher})
    return np.flatnonzero(np.unpackbits(host.numpy().view(np.uint8), bitorder="little")[:vocab])


def _whole(data: bytes) -> bool:
    """Whether `data` is UTF-8 that ends with a whole character."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _within(code: str, text: str) -> bool:
    return regex.fullmatch(f"[{language.characters(code)}]*", text) is not None


def test_on_a_vocabulary_of_several_scripts_the_mask_allows_exactly_the_locks_characters_byte_by_byte():
    tokenizer, runtime = _test_vocabulary()
    vocab, masks = len(tokenizer), TokenMasks(1, len(tokenizer), torch.device("cpu"))
    token = {runtime.bytes[t]: t for t in range(vocab)}

    def allowed_after(code: str, prefix: list[bytes]) -> set[bytes]:
        matcher = runtime.text_matcher(code, calls=False)
        assert matcher.consume_tokens([token[p] for p in prefix])
        return {runtime.bytes[t] for t in _allowed(masks, matcher, vocab)}

    en = allowed_after("en", [])
    assert {b"hello", b"caf\xc3\xa9", b"\xc3", b"!"} <= en and b"<|im_end|>" in en
    assert not {"中".encode(), "мир".encode(), b"\xe4\xb8", b"a\xe4", b"\xd0", b"<tool_call>"} & en
    assert allowed_after("en", [b"\xc3"]) & {b"\xa9 ", b"\xad", b"hello"} == {b"\xa9 ", b"\xad"}  # é and í only
    zh = allowed_after("zh", [])
    assert {"中文".encode(), b"\xe4\xb8", b"a\xe4", b"hello", "。".encode()} <= zh and "мир".encode() not in zh
    assert allowed_after("zh", [b"\xe4\xb8"]) & {b"\xad", b"\xb8\xad!", b"hello", b"\xe4\xb8"} == {b"\xad"}
    ru = allowed_after("ru", [])
    assert {" Привет".encode(), b"\xd0", b"hello"} <= ru and not {"中".encode(), "γεια".encode()} & ru
    assert b"<tool_call>" in {runtime.bytes[t] for t in _allowed(masks, runtime.text_matcher("en", True), vocab)}


def test_two_hundred_answers_of_random_draws_on_a_vocabulary_of_several_scripts_stay_in_the_locks_scripts():
    """Each answer: 24 bytes of draws (then as many as it takes to end its last character) at random among the
    tokens the mask allows; every token's text is checked as it comes, and every script the lock allows does come."""
    tokenizer, runtime = _test_vocabulary()
    vocab, masks = len(tokenizer), TokenMasks(1, len(tokenizer), torch.device("cpu"))
    rng = np.random.default_rng(0)
    scripts = {"en": [], "zh": [r"\p{Han}"], "ru": [r"\p{Cyrillic}"]}
    seen: dict[str, set[str]] = {code: set() for code in scripts}
    for answer in range(200):
        code = list(scripts)[answer % 3]
        matcher, data = runtime.text_matcher(code, calls=False), b""
        while len(data) < 24 or not _whole(data):
            choices = [t for t in _allowed(masks, matcher, vocab) if t != runtime.special["end"]]
            chosen = int(rng.choice(choices))
            assert matcher.consume_token(chosen)
            data += runtime.bytes[chosen]
            text = data.decode("utf-8", errors="ignore")  # (a character still being written: later)
            assert _within(code, text), (code, text)
        text = data.decode("utf-8")
        seen[code].update(s for s in scripts[code] if regex.search(s, text))
        assert not regex.search(r"[\p{Greek}\p{Arabic}\p{Hiragana}\p{Hangul}]", text)
    assert all(set(scripts[code]) == seen[code] for code in scripts)


def test_on_the_tiny_model_two_hundred_locked_answers_have_no_token_outside_the_scripts():
    """200 written answers of the real Thinker, drawing over its whole vocabulary (byte fragments of every script,
    special tokens), ten sessions at once, locked to en, zh or ru: their text is whole UTF-8 within the lock's
    characters, and the system turn says which language."""
    engine = engine_for(prefill_chunk_s=0)
    tokens = 0

    async def answers_on(seeds: range) -> None:
        nonlocal tokens
        for seed in seeds:
            code = ("en", "zh", "ru")[seed % 3]
            session = engine.new_session(SessionOptions(seed=seed, speech=False, max_answer_tokens=16,
                                                        thinker_sampling=WIDE, language=code))
            try:
                await session.push_text("Tell me something.")
                done = [event async for event in session.respond()][-1]
                made = session.context.segments[-1].ids[3:-2]  # the answer as the history holds it
                tokens += len(made)
                assert _within(code, engine.tokenizer.decode(made)) and "\ufffd" not in done.text, done.text
                assert language.instruction(code) in engine.tokenizer.decode(session.context.segments[0].ids)
            finally:
                await session.close()

    async def all_answers() -> None:
        await asyncio.gather(*(answers_on(range(first, 200, 10)) for first in range(10)))

    run(all_answers(), timeout_s=600)
    assert tokens >= 200 * 15


def test_an_unknown_language_is_refused_and_changes_nothing():
    engine = engine_for(prefill_chunk_s=0)
    with pytest.raises(ValueError, match="unknown language 'xx'"):
        SessionOptions(language="xx")
    session = engine.new_session(SessionOptions(language="en"))
    with pytest.raises(ValueError, match="unknown language"):
        session.update(language="klingon")
    assert session.options.language == "en"
    run(session.close())
