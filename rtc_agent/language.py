"""The language lock: a session setting that holds the Thinker's text to one language's scripts (the advice for the
Talker's voice drifting across languages is to fix the language at the application's layer).

Every text token of an answer is drawn under a mask that llguidance computes from a grammar of the answer's text,
`/[allowed characters]*/` then `<|im_end|>` (or `<tool_call>`, where the model may open a function call), through
the same path as a function call's grammar (tools.py, `TokenMasks`). llguidance matches bytes, so a byte-level
vocabulary is handled exactly: a token that is a fragment of a UTF-8 character is allowed only where it continues a
prefix of an allowed character and could be completed into one (the lead byte of a Han character is refused under
`en`, and after it under `zh` only its continuation bytes are allowed). The system turn says so too.

Each language allows its own script(s), the Latin letters (names, units, brands), the ASCII digits, punctuation and
symbols, the Latin-1 and general punctuation (« » ¿ — … “ ”), spaces and newlines; the CJK languages their
punctuation and full-width forms as well.
"""
from __future__ import annotations

COMMON = r"\x20-\x40\x5B-\x60\x7B-\x7E\n\u00A0-\u00BF\u2000-\u206F"
CJK_PUNCTUATION = r"\u3000-\u303F\uFF01-\uFF65"
LATIN = r"\p{Latin}"
# code -> (its name, the letters it allows besides COMMON)
LANGUAGES: dict[str, tuple[str, str]] = {
    "en": ("English", LATIN),
    "de": ("German", LATIN),
    "es": ("Spanish", LATIN),
    "fr": ("French", LATIN),
    "it": ("Italian", LATIN),
    "pt": ("Portuguese", LATIN),
    "ru": ("Russian", r"\p{Cyrillic}" + LATIN),
    "zh": ("Chinese", r"\p{Han}" + LATIN + CJK_PUNCTUATION),
    "ja": ("Japanese", r"\p{Han}\p{Hiragana}\p{Katakana}" + LATIN + CJK_PUNCTUATION),
    "ko": ("Korean", r"\p{Hangul}" + LATIN + CJK_PUNCTUATION),
}


def check(code: str | None) -> str | None:
    """`code` if it is a language this lock knows (None: no lock); ValueError otherwise."""
    if code is not None and code not in LANGUAGES:
        raise ValueError(f"unknown language {str(code)[:20]!r}: choose one of {', '.join(LANGUAGES)}")
    return code


def characters(code: str) -> str:
    """The characters `code` allows, as the inside of a regular expression's class (Rust's and Python's `regex`
    syntax alike)."""
    return LANGUAGES[code][1] + COMMON


def grammar(code: str, end: int, call: int | None) -> str:
    """The Lark grammar (llguidance's dialect) of an answer's text in `code`: its characters, then the token `end`
    or, where a function call may follow, the token `call`."""
    ending = f"<[{end}]>" if call is None else f"(<[{end}]> | <[{call}]>)"
    return f"start: text {ending}\ntext: /[{characters(code)}]*/\n"


def instruction(code: str) -> str:
    """What the system turn says of the lock."""
    return f"Always answer in {LANGUAGES[code][0]}."
