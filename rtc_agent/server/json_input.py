"""Strict, bounded JSON for everything a client sends (HTTP bodies, data-channel messages).

Python's json module recurses once per nesting level (a body nested 100 000 deep raises RecursionError), accepts
NaN and Infinity, and reads 1e400 as infinity. Here the nesting depth is counted before parsing, and
non-standard constants are refused; numbers that do not fit a field are the field checks' business.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .errors import ProtocolError

MAX_DEPTH = 64
# a JSON string (skipped whole, so brackets inside it do not count) or a bracket
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in `text` (an upper bound for malformed text)."""
    depth = deepest = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Parses client JSON; any problem is a ProtocolError `invalid_json`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("invalid_json", "the JSON is not UTF-8 text") from None
    if nesting_depth(text) > max_depth:
        raise ProtocolError("invalid_json", f"the JSON is nested more than {max_depth} levels deep")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"the JSON cannot be parsed: {str(exc)[:200]}") from None
