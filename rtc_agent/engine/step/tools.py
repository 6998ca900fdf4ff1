"""Function calling: the tools a session offers the Thinker, shown to it the way Qwen3's chat template shows them,
and the constraint that keeps every call it writes inside its tool's schema.

The model calls a function the Qwen3 way: `<tool_call>`, a newline, `{"name": ..., "arguments": {...}}`, a newline,
`</tool_call>` (more calls may follow, each after a newline), then `<|im_end|>`. From the token that opens a call
(the model's own choice with `tool_choice` "auto"; the answer's first token with "required" or a named function)
every token is drawn under a mask that llguidance computes from a grammar of exactly that text, with each tool's
`parameters` schema for its arguments: the arguments always parse and always validate. The mask is one bit per
token of the vocabulary, computed while the GPU runs the Thinker's graphed step and applied to its logits right
after it (`TokenMasks`): data, the same kernels for every row of the batch.

Why llguidance: no dependencies (one abi3 wheel), a JSON Schema and Lark compiler that needs no per-schema token
tables (a new tool list compiles in about a millisecond), masks in tens of microseconds on a 152k vocabulary, and
maintained by the guidance-ai team and used by vLLM, SGLang and llama.cpp. (xgrammar pulls in torch, transformers,
triton, pydantic and a TVM runtime of its own; outlines-core builds a token index per schema up front.)

What a schema leaves open is bounded (a string without `maxLength` is at most `DEFAULT_MAX_STRING` characters, an
array without `maxItems` at most `DEFAULT_MAX_ITEMS` items, and an object takes only the properties it names unless
`additionalProperties` says otherwise), and the grammar knows the tokens left in the answer's budget: a call always
ends within it, whatever the model draws and on any tokenizer. From the state of a call, its *closing* is the
shortest way to finish it that this module finds: byte by byte (one single-byte token each: every byte-level
vocabulary has them), close the open string, then `}`, `]` and the closing newline at the earliest point the grammar
allows them, with the shortest values (`0`, `""`) where a required property or item must come first (`closing`).
One token lengthens the closing by at most `step` bytes for each byte of it that may open something (`,[{":\\`, the
`STRUCTURE` bytes), plus one `step` for what its other bytes may start (a longer enum value or key, a UTF-8
character, an escape): `step` is the longest closing of a fresh value of any of the tools' sub-schemas, plus the
longest property name (`ToolRuntime.costs`). So before each draw in a call, with `slack` tokens to spare after the
draw and the closing: a token with k such bytes may be drawn while (k + 1) step <= slack, and so may the closing's
next token (a fixed mask of those, on top of the grammar's); once no other token may, the closing itself is drawn,
one forced token after the other. The call's `</tool_call>` comes one token before the budget's end at the latest,
leaving the answer's `<|im_end|>` its room. The JSON is written as the model was trained to write it: `", "` and
`": "`, no other whitespace.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from ... import language as languages
from ..events import ToolCallArguments, ToolCallDone, ToolCallStarted
from .graphs import DeviceCopy, to_device

if TYPE_CHECKING:
    from llguidance import LLMatcher  # imported where it is used: only a call with tools needs it

CHOICES = ("auto", "none", "required")  # or the name of one tool
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 64
MAX_SCHEMA_CHARS = 32_000
DEFAULT_MAX_STRING = 256
DEFAULT_MAX_ITEMS = 16
MIN_CALL_ROOM = 64  # tokens left in the answer's budget for another call to start after one
MASK_THREADS = 4  # llguidance's threads for the masks of the rows in a call (a step's masks at once)
# what a draw may take: a grammar's state (llguidance.LLMatcher), a fixed mask, or the two at once (both must allow)
Constraint = Union["LLMatcher", np.ndarray, tuple["LLMatcher", np.ndarray]]
STRUCTURE = frozenset(b',[{":\\')  # bytes of a call that may open something it must then close (module docstring)
CLOSERS = b'}]\n0"'  # the closing's bytes outside a string, in the order it prefers them
NO_COST = 64  # a sub-schema's cost where it cannot be compiled on its own (a $ref to a path outside $defs)
CALL_PREFIX = '{"name": "'  # how every call's JSON starts (the grammar writes it so)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    """A function the application offers the model: its name, what it does, and a JSON Schema of its arguments
    (kept as JSON text: options are frozen and cross to the engine process)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(f"a tool's name must be 1 to 64 letters, digits, _ or -, not {str(self.name)[:80]!r}")
        if not isinstance(self.description, str) or len(self.description) > 4000:
            raise ValueError(f"tool {self.name}: description must be a string of at most 4000 characters")
        if not isinstance(self.parameters, str) or len(self.parameters) > MAX_SCHEMA_CHARS:
            raise ValueError(f"tool {self.name}: parameters must be a JSON Schema of at most {MAX_SCHEMA_CHARS} "
                             "characters")
        schema = json.loads(self.parameters)
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ValueError(f"tool {self.name}: parameters must be a JSON Schema of an object")

    @classmethod
    def function(cls, name: str, description: str = "", parameters: dict[str, Any] | None = None) -> "Tool":
        return cls(name, description, json.dumps(parameters if parameters is not None else
                                                  {"type": "object", "properties": {}}))

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)


@dataclass(frozen=True)
class ToolSet:
    """A session's tools and how the model may use them: `choice` is "auto" (the model decides), "none" (it may
    not call), "required" (it must call one) or a tool's name (it must call that one); with `parallel` an answer
    may make several calls one after the other."""

    tools: tuple[Tool, ...] = ()
    choice: str = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} tools")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        if self.choice not in CHOICES and self.choice not in names:
            raise ValueError(f"tool_choice must be auto, none, required or the name of a tool, not "
                             f"{str(self.choice)[:80]!r}")
        if self.choice == "required" and not self.tools:
            raise ValueError('tool_choice "required" needs at least one tool')
        if self.tools:
            error = _validate(call_grammar(self, opened=False))
            if error:
                raise ValueError(f"a tool's parameters cannot be enforced: {error}")

    @property
    def forced(self) -> bool:
        """Whether every answer must be a call (it starts with `<tool_call>`)."""
        return bool(self.tools) and self.choice not in ("auto", "none")

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name (all of them unless one is named)."""
        return tuple(t for t in self.tools if self.choice in CHOICES or t.name == self.choice)


def system_text(instructions: str, tools: tuple[Tool, ...], language: str | None = None) -> str:
    """The system turn's text: the instructions, what the language lock holds answers to, and the tools listed, as
    Qwen3's chat template writes them."""
    if language is not None:
        instructions = f"{instructions}\n\n{languages.instruction(language)}" if instructions else \
            languages.instruction(language)
    if not tools:
        return instructions
    lines = "".join("\n" + json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.schema}}, ensure_ascii=False) for t in tools)
    head = instructions + "\n\n" if instructions else ""
    return (f"{head}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def bounded(schema: Any) -> Any:
    """`schema` with what it leaves open bounded (module docstring)."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (bounded(v) if k not in ("enum", "const", "default", "examples", "required", "properties") else v)
           for k, v in schema.items()}
    types = _types(out)
    if "string" in types and "maxLength" not in out and "enum" not in out and "const" not in out:
        out["maxLength"] = DEFAULT_MAX_STRING
    if "array" in types and "maxItems" not in out:
        out["maxItems"] = DEFAULT_MAX_ITEMS
    if "object" in types and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: bounded(s) for name, s in out["properties"].items()}
    return out


def _types(schema: dict[str, Any]) -> set[str]:
    """The types a schema names (`"type": "string"` or `["string", "null"]`)."""
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} if isinstance(kind, list) \
        else set()


def call_grammar(tools: ToolSet, opened: bool, special: dict[str, int] | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of an answer's calls: from the token after `<tool_call>` when
    `opened` (the model opened the call itself), else from `<tool_call>` on. `special`: the ids of <tool_call>,
    </tool_call> and <|im_end|> (the released model's by default)."""
    ids = special or {"open": 151657, "close": 151658, "end": 151645}
    one_of = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": bounded(t.schema)},
               "required": ["name", "arguments"], "additionalProperties": False} for t in tools.callable]
    schema = {**(one_of[0] if len(one_of) == 1 else {"anyOf": one_of}), "x-guidance": JSON_STYLE}
    more = f' ("\\n" <[{ids["open"]}]> call)*' if tools.parallel else ""
    opening = "" if opened else f"<[{ids['open']}]> "
    return (f"start: {opening}call{more} <[{ids['end']}]>\n"
            f'call: "\\n" arguments "\\n" <[{ids["close"]}]>\n'
            f"arguments: %json {json.dumps(schema)}\n")


def _validate(grammar: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(grammar))
    return messages[0] if is_error else ""


class ToolRuntime:
    """The engine's side: the model's tokenizer as llguidance reads it (built once, about half a second) and the
    compiled grammars of the tool sets and language locks in use."""

    def __init__(self, tokenizer: Any, vocab: int, open_id: int, close_id: int, end_id: int) -> None:
        import llguidance.hf

        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self.special = {"open": open_id, "close": close_id, "end": end_id}
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self._matchers: dict[tuple[ToolSet | str, bool], Any] = {}
        self._costs: dict[ToolSet, tuple[int, int]] = {}
        self.bytes = [self.tokenizer.decode_bytes([t]) for t in range(vocab)]
        regular = [not self.tokenizer.is_special_token(t) for t in range(vocab)]
        self.byte_token = {b[0]: t for t, b in enumerate(self.bytes) if len(b) == 1 and regular[t]}
        self.fallback = np.array([*(self.byte_token[b] for b in sorted(self.byte_token)), end_id, open_id])
        openers = np.array([sum(c in STRUCTURE for c in b) if r else 0 for b, r in zip(self.bytes, regular)])
        # at_most[k]: the tokens with at most k STRUCTURE bytes
        self.at_most = [_pack(openers <= k, self.words) for k in range(int(openers.max()))]
        self.no_calls = np.full(self.words, -1, dtype=np.int32)  # every token but <tool_call>
        self.no_calls.view(np.uint32)[open_id // 32] &= ~np.uint32(1 << (open_id % 32))
        self.end_only = np.zeros(self.words, dtype=np.int32)  # <|im_end|> alone
        self.end_only.view(np.uint32)[end_id // 32] = np.uint32(1 << (end_id % 32))

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab: int, end_id: int) -> "ToolRuntime | None":
        """The runtime for a model's tokenizer, None if it has no <tool_call> and </tool_call> tokens."""
        ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            return None
        return cls(tokenizer, vocab, ids[0], ids[1], end_id)

    def matcher(self, tools: ToolSet, opened: bool) -> Any:
        """A fresh matcher of `tools`' calls (compiled once per tool set)."""
        from llguidance import LLMatcher

        key = (tools, opened)
        if key not in self._matchers:
            if len(self._matchers) >= 64:
                del self._matchers[next(iter(self._matchers))]
            grammar = LLMatcher.grammar_from_lark(call_grammar(tools, opened, self.special))
            compiled = LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"the tools' grammar does not compile: {compiled.get_error()}")
            self._matchers[key] = compiled
        return self._matchers[key].deep_copy()

    def text_matcher(self, language: str, calls: bool) -> Any:
        """A fresh matcher of an answer's text under the language lock (language.py); `calls`: a function call
        may follow the text."""
        key = (language, calls)
        if key not in self._matchers:
            from llguidance import LLMatcher

            grammar = languages.grammar(language, self.special["end"], self.special["open"] if calls else None)
            self._matchers[key] = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        return self._matchers[key].deep_copy()

    def one_token(self, token: int) -> np.ndarray:
        """The mask of `token` alone."""
        words = np.zeros(self.words, dtype=np.uint32)
        words[token // 32] = np.uint32(1 << (token % 32))
        return words.view(np.int32)

    def costs(self, tools: ToolSet) -> tuple[int, int]:
        """`tools`' `step` (the most one token without STRUCTURE bytes can lengthen a call's closing: module
        docstring) and the length of the shortest call from its `<tool_call>` on, in tokens (computed once)."""
        if tools not in self._costs:
            from llguidance import LLMatcher

            names, values = set(), []
            for tool in tools.callable:
                schema = bounded(tool.schema)
                defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
                for sub in _subschemas(schema):
                    names.update(sub["properties"] if isinstance(sub.get("properties"), dict) else ())
                    grammar = LLMatcher.grammar_from_lark(
                        f"start: value\nvalue: %json {json.dumps({**defs, **sub, 'x-guidance': JSON_STYLE})}\n")
                    matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
                    values.append(NO_COST if matcher.is_error() else len(self.closing(matcher, _Scan(), None)))
            step = max(values) + max((len(json.dumps(n)) for n in names), default=2) + len(', "": ')
            call = 1 + len(self.closing(self.matcher(tools, opened=True), _Scan(), self.special["close"]))
            self._costs[tools] = (step, call)
        return self._costs[tools]

    def closing(self, matcher: Any, scan: "_Scan", stop: int | None) -> list[int]:
        """The closing's tokens from `matcher`'s state (module docstring), up to `stop` (a call's </tool_call>) or
        the grammar's end; `scan`: where the JSON so far is (in a string or not). The matcher is left as it was."""
        tokens: list[int] = []
        scan = _Scan(scan.in_string, scan.escaped)
        try:
            while not matcher.is_stopped() and not (stop is None and matcher.is_accepting()):
                token = self._closer(matcher, scan, stop)
                tokens.append(token)
                if token == stop or token == self.special["end"]:
                    break
                scan.feed(self.bytes[token])
            return tokens
        finally:
            matcher.rollback(len(tokens))

    def _closer(self, matcher: Any, scan: "_Scan", stop: int | None) -> int:
        """The closing's next token, taken into `matcher`."""
        forced = matcher.compute_ff_bytes()  # (bytes the grammar allows no alternative to: a key's rest, ": ")
        if forced and forced[0] in self.byte_token and matcher.try_consume_tokens([self.byte_token[forced[0]]]):
            return self.byte_token[forced[0]]
        preferred = b'"' if scan.in_string and not scan.escaped else b"" if scan.in_string else CLOSERS
        candidates = ([stop] if stop is not None else []) + [self.byte_token[b] for b in preferred
                                                              if b in self.byte_token]
        for token in candidates:
            if matcher.try_consume_tokens([token]):
                return token
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        for token in self.fallback[(words[self.fallback >> 5] >> (self.fallback & 31)) & 1 == 1].tolist():
            if matcher.try_consume_tokens([token]):
                return token
        raise RuntimeError("a call's grammar allows no single-byte token: it cannot be closed")


def _pack(allowed: np.ndarray, words: int) -> np.ndarray:
    """Booleans by token as llguidance's mask words."""
    bits = np.zeros(words * 32, dtype=bool)
    bits[:len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """`schema` and every schema inside it."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for sub in value.values():
                yield from _subschemas(sub)
        elif key in ("items", "additionalProperties", "contains", "not", "if", "then", "else"):
            for sub in value if isinstance(value, list) else [value]:
                yield from _subschemas(sub)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            for sub in value:
                yield from _subschemas(sub)


@dataclass
class _Scan:
    """Whether the JSON written so far ends inside a string (and right after its backslash)."""

    in_string: bool = False
    escaped: bool = False

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.escaped:
                self.escaped = False
            elif self.in_string and byte == 0x5C:
                self.escaped = True
            elif byte == 0x22:
                self.in_string = not self.in_string


class TokenMasks:
    """Which tokens each row of the Thinker's batch may draw, one bit per token (llguidance's layout: bit j of word
    i is token 32 i + j), for a step with a row in a function call. The step's forward pass is queued first; the
    rows in a call then have their masks computed by llguidance's threads, all at once, straight into a pinned
    staging buffer, while the GPU runs that forward pass; the copy and the masking follow it on the stream. Every
    row of the batch is masked the same way (all ones for a row not in a call): data, not a branch per row."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.words = (vocab + 31) // 32
        self.staging = DeviceCopy((rows, self.words), torch.int32, device)
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._executor: Any = None

    def apply(self, logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] with -inf where `words` [rows, words] has a 0 bit."""
        allowed = ((words.unsqueeze(-1) >> self.shifts) & 1).flatten(1)[:, :logits.shape[-1]]
        return logits.masked_fill(allowed == 0, float("-inf"))

    def send(self, constraints: dict[int, Constraint]) -> torch.Tensor | None:
        """The rows' masks (`constraints`: row -> a call's matcher or a fixed mask; every other row all ones),
        their copy queued on the current stream; returns them on the device [rows, words], None without any."""
        if not constraints:
            return None
        self.staging.wait_sent()
        host = self.staging.host
        host.fill_(-1)
        self._fill(host, constraints)
        return self.staging.send()

    def one(self, constraint: Constraint) -> torch.Tensor:
        """One row's mask on the device [1, words], for a draw outside the batched step (an answer's first)."""
        host = torch.full((1, self.words), -1, dtype=torch.int32)
        self._fill(host, {0: constraint})
        return to_device(host, self.staging.device.device)

    def _fill(self, host: torch.Tensor, constraints: dict[int, Constraint]) -> None:
        """The rows' masks into `host` (its other rows as they are): fixed masks copied, the grammars' computed."""
        matchers, fixed = [], []
        for row, constraint in constraints.items():
            matcher, mask = (None, constraint) if isinstance(constraint, np.ndarray) else \
                constraint if isinstance(constraint, tuple) else (constraint, None)
            if matcher is not None:
                matchers.append((matcher, row))
            if mask is not None:
                fixed.append((row, torch.from_numpy(mask), matcher is not None))
        if matchers:
            self._compute(matchers, host)
        for row, mask, both in fixed:
            host[row] = host[row] & mask if both else mask

    def _compute(self, matchers: list[tuple[Any, int]], host: torch.Tensor) -> None:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=min(MASK_THREADS, os.cpu_count() or 1))
        self._executor.unsafe_compute_mask_ptr(matchers, host.data_ptr(), self.words * 4, host.shape[0])


@dataclass
class _Call:
    tokens: list[int] = field(default_factory=list)  # after <tool_call>, up to </tool_call>
    utf8: bytes = b""  # their text
    name: str | None = None
    sent: int = 0  # characters of its arguments sent as deltas
    scan: _Scan = field(default_factory=_Scan)


class AnswerCalls:
    """One answer's function calls: the mask on each of its tokens, and the events its calls make.

    `take` is given every token the answer draws, in order; it says whether the token is the answer's text (spoken
    or written) or belongs to a call. Text comes before the first call; once a call opens, the rest of the answer
    is calls (the grammar ends it with <|im_end|>)."""

    def __init__(self, runtime: ToolRuntime, tools: ToolSet, budget: int, emit: Callable[[Any], None]) -> None:
        """`budget`: the answer's most tokens."""
        self.runtime, self.tools, self.budget, self.emit = runtime, tools, budget, emit
        self.matcher = runtime.matcher(tools, opened=False) if tools.forced else None
        self.step, self.call_cost = runtime.costs(tools) if tools.tools else (0, 0)
        self.forced: list[int] = []  # the closing being drawn, once the budget left no room for free draws
        self.closing_tokens = 0  # the tokens of its calls that the budget forced (their closings)
        self.calls: list[_Call] = []
        self.done: list[ToolCallDone] = []
        self.in_calls = False  # a call has opened: no more text
        self.text_tokens = 0  # the answer's tokens before its first call
        self.complete_tokens = 0  # its tokens up to the end of the last complete call
        self._seen = 0
        self.spent_s = 0.0  # host time on its calls (the grammar's state, their closing, their events)

    def constraint(self) -> Constraint | None:
        """What the answer's next draw may take: in a call, the grammar's state, with the tokens left in the
        answer's budget (module docstring); a fixed mask (no call with `tool_choice` none; the answer's end), or
        None for any token. After a call, another one may start only with room for twice the longest so far (at
        least `MIN_CALL_ROOM` tokens, and the shortest call's): the answer ends rather than cut a call short."""
        if self.matcher is not None and self._seen == self.complete_tokens and self.done:
            room = max(MIN_CALL_ROOM, 2 * max(len(c.tokens) + 2 for c in self.calls), self.call_cost + 2 * self.step)
            if not self.tools.parallel or self.budget - self._seen < room:
                return self.runtime.end_only
            return self.matcher
        if self.matcher is not None:
            started = time.perf_counter()
            try:
                return self._in_call()
            finally:
                self.spent_s += time.perf_counter() - started
        if self.tools.choice == "none":
            return self.runtime.no_calls
        return None

    def _in_call(self) -> Constraint:
        """A call's next draw: free under the grammar while the closing fits with room to spare; nearer the
        budget's end, a token with fewer STRUCTURE bytes or the closing's next; then the closing itself (module
        docstring)."""
        if self.forced:
            return self.runtime.one_token(self.forced[0])
        left = self.budget - 1 - self._seen  # the tokens still to come, <|im_end|>'s apart
        closing = self.runtime.closing(self.matcher, self.calls[-1].scan if self.calls else _Scan(),
                                       self.runtime.special["close"])
        most = (left - 1 - len(closing)) // self.step - 1  # STRUCTURE bytes the token drawn now may have
        if most < 0:
            self.forced = closing
            return self.runtime.one_token(closing[0])
        if most >= len(self.runtime.at_most):
            return self.matcher
        return self.matcher, self.runtime.at_most[most] | self.runtime.one_token(closing[0])

    def take(self, token: int) -> bool:
        """The answer drew `token`; returns True when it is text (before any call)."""
        started = time.perf_counter()
        try:
            return self._take(token)
        finally:
            self.spent_s += time.perf_counter() - started

    def _take(self, token: int) -> bool:
        self._seen += 1
        special = self.runtime.special
        if self.matcher is None and token == special["open"] and self.tools.choice != "none":
            self.matcher = self.runtime.matcher(self.tools, opened=True)  # the model opened a call itself
            self.in_calls = True
            self.calls.append(_Call())
            return False
        if self.matcher is None:
            self.text_tokens = self._seen
            return True
        if self.forced:
            if self.forced.pop(0) != token:
                raise RuntimeError("a token other than the forced closing's was drawn")
            self.closing_tokens += 1
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"a token outside the tools' grammar was drawn: {self.matcher.get_error()}")
        self.in_calls = True
        if token == special["open"]:
            self.calls.append(_Call())
        elif token == special["close"]:
            self._finish(self.calls[-1])
            self.complete_tokens = self._seen
        elif token != special["end"] and self.calls:
            self._advance(self.calls[-1], token)
        return False

    def _advance(self, call: _Call, token: int) -> None:
        call.tokens.append(token)
        call.utf8 += self.runtime.bytes[token]
        call.scan.feed(self.runtime.bytes[token])
        text = call.utf8.decode("utf-8", errors="ignore").lstrip("\n")  # (a character split across tokens: later)
        if call.name is None:
            match = re.match(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ', text)
            if match is None:
                return
            call.name = match.group(1)
            self.emit(ToolCallStarted(len(self.calls) - 1, call.name))
        arguments = text[len(CALL_PREFIX) + len(call.name) + len('", "arguments": '):]
        certain = arguments.rstrip("}\n")  # the end may be the call's own closing brace
        if len(certain) > call.sent:
            self.emit(ToolCallArguments(len(self.calls) - 1, certain[call.sent:]))
            call.sent = len(certain)

    def _finish(self, call: _Call) -> None:
        text = call.utf8.decode("utf-8").strip("\n")
        parsed = json.loads(text)  # the grammar wrote it: it parses
        arguments = text[len(CALL_PREFIX) + len(call.name) + len('", "arguments": '):-1]
        assert json.loads(arguments) == parsed["arguments"] and parsed["name"] == call.name
        if len(arguments) > call.sent:
            self.emit(ToolCallArguments(len(self.calls) - 1, arguments[call.sent:]))
        done = ToolCallDone(len(self.calls) - 1, call.name, arguments)
        self.done.append(done)
        self.emit(done)
