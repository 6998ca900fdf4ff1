"""The wire contract: the offer body, the client's data-channel messages, the server's session description.

Names follow the OpenAI Realtime API where one fits (see README.md, "The contract").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import EAGERNESS_LEVELS, VOICES, TurnSettings
from . import json_input
from .errors import ProtocolError
from .sdp_offer import check_offer

MAX_INSTRUCTIONS = 8000
MAX_MESSAGE_BYTES = 64 * 1024
MAX_NUMBER = 1e9  # no setting is anywhere near this; it keeps NaN, infinities and 400-digit integers out


@dataclass(frozen=True)
class Offer:
    sdp: str
    voice: str | None
    instructions: str | None
    resume_token: str | None = None  # a call's token from session.created: a new connection for that call


@dataclass(frozen=True)
class SessionUpdate:
    voice: str | None
    instructions: str | None
    turn: TurnSettings | None  # None: unchanged
    text_only: bool | None = None  # output_modalities ["text"]: True, ["audio"]: False; None: unchanged


@dataclass(frozen=True)
class Commit:
    pass


@dataclass(frozen=True)
class CancelResponse:
    pass


ClientMessage = SessionUpdate | Commit | CancelResponse


def _voice(value: Any) -> str | None:
    if value is None:
        return None
    if value not in VOICES:
        raise ProtocolError("invalid_value", f"voice must be one of {', '.join(VOICES)}")
    return str(value)


def text_value(value: Any, name: str, max_chars: int) -> str:
    """A client's free text: a string of at most `max_chars` that is valid Unicode (JSON can carry lone UTF-16
    surrogates such as "\\ud800", which no tokenizer can encode)."""
    if not isinstance(value, str) or len(value) > max_chars:
        raise ProtocolError("invalid_value", f"{name} must be a string of at most {max_chars} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError("invalid_value", f"{name} holds a lone surrogate: it is not valid Unicode text") from None
    return value


def output_modalities(text_only: bool) -> list[str]:
    """The Realtime API's name for what an answer is: audio (with its transcript) or text."""
    return ["text"] if text_only else ["audio"]


def _text_only(value: Any) -> bool:
    if value not in (["text"], ["audio"]):
        raise ProtocolError("invalid_value", 'output_modalities must be ["audio"] (spoken answers, with their '
                                             'transcript) or ["text"] (written answers)')
    return value == ["text"]


def _instructions(value: Any) -> str | None:
    return None if value is None else text_value(value, "instructions", MAX_INSTRUCTIONS)


def parse_offer(body: Any) -> Offer:
    """The JSON offer body (already parsed by json_input.loads), its SDP checked by sdp_offer."""
    if not isinstance(body, dict):
        raise ProtocolError("invalid_json", "the body must be a JSON object")
    sdp, kind = body.get("sdp"), body.get("type")
    if kind != "offer":
        raise ProtocolError("invalid_value", 'type must be "offer"')
    if not isinstance(sdp, str) or not sdp.startswith("v=0"):
        raise ProtocolError("invalid_value", "sdp must be an SDP offer")
    resume = body.get("resume_token")
    if resume is not None and (not isinstance(resume, str) or not 0 < len(resume) <= 128):
        raise ProtocolError("invalid_value", "resume_token must be the token from session.created")
    voice, instructions = _voice(body.get("voice")), _instructions(body.get("instructions"))
    check_offer(sdp)
    return Offer(sdp=sdp, voice=voice, instructions=instructions, resume_token=resume)


# session.update's turn_detection <-> TurnSettings
_TURN_KEYS = {
    "threshold": ("vad_threshold", float),
    "silence_duration_ms": ("silence_ms", int),
    "prefix_padding_ms": ("prefix_padding_ms", int),
    "min_speech_duration_ms": ("min_speech_ms", int),
    "barge_in_ms": ("barge_in_ms", int),
}


_SERVER_VAD_ONLY = {"silence_duration_ms"}


def _turn(value: Any, current: TurnSettings) -> TurnSettings:
    if value is None or value == {"type": "none"}:
        return dataclasses.replace(current, auto=False)
    kind = value.get("type", "server_vad") if isinstance(value, dict) else None
    if kind not in ("server_vad", "semantic_vad"):
        raise ProtocolError("invalid_value", 'turn_detection must be null, {"type": "server_vad", ...} or '
                                             '{"type": "semantic_vad", "eagerness"?: ...}')
    changes: dict[str, Any] = {"auto": True, "turn_detection": kind}
    for key, raw in value.items():
        if key == "type":
            continue
        if key == "eagerness" and kind == "semantic_vad":
            if raw not in EAGERNESS_LEVELS:
                raise ProtocolError("invalid_value", f"turn_detection.eagerness must be one of "
                                                     f"{', '.join(EAGERNESS_LEVELS)}")
            changes["eagerness"] = raw
            continue
        if key not in _TURN_KEYS or (kind == "semantic_vad" and key in _SERVER_VAD_ONLY):
            raise ProtocolError("unknown_parameter", f"turn_detection.{key} is not a {kind} setting")
        name, number = _TURN_KEYS[key]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not -MAX_NUMBER < raw < MAX_NUMBER:
            raise ProtocolError("invalid_value", f"turn_detection.{key} must be a finite number")
        changes[name] = number(raw)
    turn = dataclasses.replace(current, **changes)
    if not 0.0 < turn.vad_threshold < 1.0:
        raise ProtocolError("invalid_value", "turn_detection.threshold must be between 0 and 1")
    for name in ("silence_ms", "prefix_padding_ms", "min_speech_ms", "barge_in_ms"):
        if not 0 <= getattr(turn, name) <= 10_000:
            raise ProtocolError("invalid_value", "durations must be between 0 and 10000 ms")
    return turn


def turn_description(turn: TurnSettings) -> dict[str, Any] | None:
    if not turn.auto:
        return None
    out: dict[str, Any] = {"type": turn.turn_detection}
    if turn.turn_detection == "semantic_vad":
        out["eagerness"] = turn.eagerness
    for key, (name, _) in _TURN_KEYS.items():
        if turn.turn_detection == "server_vad" or key not in _SERVER_VAD_ONLY:
            out[key] = getattr(turn, name)
    return out


def parse_client_message(text: str | bytes, turn: TurnSettings) -> ClientMessage:
    if not isinstance(text, str) or len(text) > MAX_MESSAGE_BYTES:
        raise ProtocolError("invalid_json", "messages are JSON text of at most 64 KiB")
    msg = json_input.loads(text)
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("invalid_json", 'a message is a JSON object with a "type"')
    kind = msg["type"]
    if kind == "session.update":
        session = msg.get("session")
        if not isinstance(session, dict):
            raise ProtocolError("invalid_value", 'session.update needs a "session" object')
        unknown = set(session) - {"voice", "instructions", "turn_detection", "output_modalities"}
        if unknown:
            raise ProtocolError("unknown_parameter", f"session.{sorted(unknown)[0]} cannot be updated")
        return SessionUpdate(
            voice=_voice(session.get("voice")),
            instructions=_instructions(session.get("instructions")),
            turn=_turn(session["turn_detection"], turn) if "turn_detection" in session else None,
            text_only=_text_only(session["output_modalities"]) if "output_modalities" in session else None,
        )
    if kind == "input_audio_buffer.commit":
        return Commit()
    if kind == "response.cancel":
        return CancelResponse()
    raise ProtocolError("unknown_event", f"unknown message type {kind!r}")


def error_event(code: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message}}
