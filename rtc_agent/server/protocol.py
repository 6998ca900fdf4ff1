"""The wire contract: the offer body, the client's data-channel messages, the server's session description.

Names follow the OpenAI Realtime API where one fits (see docs/api.md, "The data channel").
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from .. import language as languages
from ..config import EAGERNESS_LEVELS, VOICES, TurnSettings
from ..engine.step.tools import CHOICES, MAX_TOOLS, Tool, ToolSet
from ..media import moonshine
from ..media.captions import Transcription
from . import json_input
from .errors import ProtocolError
from .sdp_offer import check_offer

MAX_INSTRUCTIONS = 8000
MAX_TOOL_OUTPUT = 8000  # characters of a function's result (it joins the context as the caller's words do)
MAX_MESSAGE_BYTES = 64 * 1024
MAX_NUMBER = 1e9  # no setting is anywhere near this; it keeps NaN, infinities and 400-digit integers out
MAX_MODEL_NAME = 200
OFF = "off"  # a transcription setting turned off (null in JSON; None in an update means unchanged)
TranscriptionChange = Transcription | Literal["off"] | None


@dataclass(frozen=True)
class Offer:
    sdp: str
    voice: str | None
    instructions: str | None
    resume_token: str | None = None  # a call's token from session.created: a new connection for that call
    transcription: TranscriptionChange = None  # input_audio_transcription (None: the server's default)
    ice: str = ""  # the ICE credentials of its audio line (sdp_offer.check_offer): the same offer again has them
    language: str | None = None  # the language lock (language.py); None: the server's (--language)


@dataclass(frozen=True)
class SessionUpdate:
    voice: str | None
    instructions: str | None
    turn: TurnSettings | None  # None: unchanged
    text_only: bool | None = None  # output_modalities ["text"]: True, ["audio"]: False; None: unchanged
    tools: tuple[Tool, ...] | None = None  # None (here and below): unchanged
    tool_choice: str | None = None  # auto, none, required or a tool's name
    parallel_tool_calls: bool | None = None
    transcription: TranscriptionChange = None
    language: str | None = None  # the language lock: a language's code, "" for none (JSON null); None: unchanged

    def tool_set(self, current: ToolSet) -> ToolSet | None:
        """The session's tools after this update (None: unchanged); ProtocolError for a combination the engine
        cannot take (a tool_choice naming no tool, parameters llguidance cannot enforce)."""
        if (self.tools, self.tool_choice, self.parallel_tool_calls) == (None, None, None):
            return None
        tools = current.tools if self.tools is None else self.tools
        choice = current.choice if self.tool_choice is None else self.tool_choice
        parallel = current.parallel if self.parallel_tool_calls is None else self.parallel_tool_calls
        if choice not in CHOICES and choice not in {t.name for t in tools}:
            raise ProtocolError("invalid_value", f"tool_choice names {choice[:64]!r}, which is not one of the "
                                                 "session's tools", "session.tool_choice")
        if choice == "required" and not tools:
            raise ProtocolError("invalid_value", 'tool_choice "required" needs at least one tool',
                                "session.tool_choice")
        try:
            return ToolSet(tools, choice, parallel)
        except ValueError as exc:
            raise ProtocolError("invalid_value", _tools_error(tools, exc), "session.tools") from None


def _tools_error(tools: tuple[Tool, ...], error: ValueError) -> str:
    """ToolSet's complaint, naming the tool at fault where there is one, without llguidance's listing of the
    grammar it was compiling."""
    where = "tools"
    for n, tool in enumerate(tools):
        try:
            ToolSet((tool,))
        except ValueError as exc:
            where, error = f"tools[{n}] ({tool.name})", exc
            break
    text = "\n".join(itertools.takewhile(lambda line: not re.match(r"\s*\d+ \| ", line), str(error).splitlines()))
    return (where + ": " + re.sub(r"at \d+\(\d+\): ", "", text).strip())[:1000]


@dataclass(frozen=True)
class ToolOutput:
    """A function_call_output: what the application's function returned for one of the answers' calls."""

    call_id: str
    output: str


@dataclass(frozen=True)
class CreateResponse:
    pass


@dataclass(frozen=True)
class Commit:
    pass


@dataclass(frozen=True)
class CancelResponse:
    pass


ClientMessage = SessionUpdate | Commit | CancelResponse | ToolOutput | CreateResponse


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
    return unicode_text(value, name)


def unicode_text(value: str, name: str, param: str | None = None) -> str:
    """`value`, refused if it is not valid Unicode (a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError("invalid_value", f"{name} holds a lone surrogate: it is not valid Unicode text",
                            param) from None
    return value


def output_modalities(text_only: bool) -> list[str]:
    """The Realtime API's name for what an answer is: audio (with its transcript) or text."""
    return ["text"] if text_only else ["audio"]


def _text_only(value: Any) -> bool:
    if value not in (["text"], ["audio"]):
        raise ProtocolError("invalid_value", 'output_modalities must be ["audio"] (spoken answers, with their '
                                             'transcript) or ["text"] (written answers)')
    return value == ["text"]


def _language(value: Any, name: str = "language") -> str:
    """A language lock's code (null: no lock, as "")."""
    if value is None:
        return ""
    try:
        return languages.check(value if isinstance(value, str) else repr(value))
    except ValueError as exc:
        raise ProtocolError("invalid_value", f"{name}: {exc}", name) from None


def _instructions(value: Any) -> str | None:
    return None if value is None else text_value(value, "instructions", MAX_INSTRUCTIONS)


def _tools(value: Any) -> tuple[Tool, ...]:
    """`tools`: function tools as the Realtime API (GA) lists them."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ProtocolError("invalid_value", f"tools must be a list of at most {MAX_TOOLS} functions", "session.tools")
    tools = []
    for n, tool in enumerate(value):
        where = f"tools[{n}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = json.dumps(tool.get("type") if isinstance(tool, dict) else tool)[:40]
            raise ProtocolError("unsupported_value", f'{where}: a tool of type {kind} is not supported by this '
                                                     'server (function tools are: {"type": "function", "name", '
                                                     '"description"?, "parameters"?})', "session.tools")
        unknown = set(tool) - {"type", "name", "description", "parameters"}
        if unknown:
            raise ProtocolError("unknown_parameter", f"{where}.{sorted(unknown)[0]} is not a function tool's field",
                                "session.tools")
        unicode_text(json.dumps(tool, ensure_ascii=False), where, "session.tools")
        try:
            tools.append(Tool.function(tool.get("name"), tool.get("description") or "", tool.get("parameters")))
        except ValueError as exc:
            raise ProtocolError("invalid_value", f"{where}: {exc}", "session.tools") from None
    return tuple(tools)


def _tool_choice(value: Any) -> str:
    """`tool_choice`: "auto", "none", "required", or {"type": "function", "name"} -> ToolSet's `choice`."""
    if value in CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"} \
            and isinstance(value["name"], str):
        return value["name"]
    raise ProtocolError("invalid_value", 'tool_choice must be "auto", "none", "required" or {"type": "function", '
                                         '"name": ...}', "session.tool_choice")


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError("invalid_value", f"{name} must be true or false", f"session.{name}")
    return value


def tool_description(tools: ToolSet) -> dict[str, Any]:
    """A session's tools in the shapes `session.update` takes them."""
    return {"tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.schema}
                      for t in tools.tools],
            "tool_choice": tools.choice if tools.choice in CHOICES else {"type": "function", "name": tools.choice},
            "parallel_tool_calls": tools.parallel}


def function_call_output(item: Any) -> ToolOutput:
    """A `conversation.item.create`'s item `{"type": "function_call_output", "call_id", "output"}` (the Realtime
    API's item fields `id`, `object` and `status` may come along)."""
    if not isinstance(item, dict) or item.get("type") != "function_call_output":
        raise ProtocolError("invalid_value", 'the item must be {"type": "function_call_output", "call_id", '
                                             '"output"}', "item")
    unknown = set(item) - {"type", "call_id", "output", "id", "object", "status"}
    if unknown:
        raise ProtocolError("unknown_parameter", f"item.{sorted(unknown)[0]} is not a function_call_output's field",
                            f"item.{sorted(unknown)[0]}"[:80])
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ProtocolError("invalid_value", "item.call_id must be the call_id of one of the answers' function calls",
                            "item.call_id")
    output = item.get("output")
    if not isinstance(output, str) or len(output) > MAX_TOOL_OUTPUT:
        raise ProtocolError("invalid_value", f"item.output must be a string of at most {MAX_TOOL_OUTPUT} characters",
                            "item.output")
    return ToolOutput(call_id, unicode_text(output, "item.output", "item.output"))


def transcription_setting(value: Any, param: str) -> Transcription | Literal["off"]:
    """A transcription setting: null (off) or {"model", "language"?, "prompt"?}. The model is taken and ignored
    (this server has one recogniser); a language it does not transcribe is refused."""
    if value is None:
        return OFF
    if not isinstance(value, dict):
        raise ProtocolError("invalid_value", f'{param} must be null or {{"model", "language"?, "prompt"?}}', param)
    unknown = set(value) - {"model", "language", "prompt"}
    if unknown:
        raise ProtocolError("unknown_parameter", f"{param}.{sorted(unknown)[0]} is not a transcription setting",
                            param)
    model, language, prompt = value.get("model", moonshine.NAME), value.get("language"), value.get("prompt")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME:
        raise ProtocolError("invalid_value", f"{param}.model must be a model's name", f"{param}.model")
    if language is not None and language not in moonshine.LANGUAGES:
        raise ProtocolError("unsupported_value", f"{param}.language: this server's recogniser ({moonshine.NAME}) "
                            f"transcribes {', '.join(moonshine.LANGUAGES)}", f"{param}.language")
    if prompt is not None:
        prompt = text_value(prompt, f"{param}.prompt", MAX_INSTRUCTIONS)
    return Transcription(unicode_text(model, f"{param}.model", f"{param}.model"), language, prompt)


def transcription_description(transcription: Transcription | None) -> dict[str, Any] | None:
    return None if transcription is None else transcription.describe()


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
    transcription = transcription_setting(body["input_audio_transcription"], "input_audio_transcription") \
        if "input_audio_transcription" in body else None
    language = _language(body["language"]) or None if body.get("language") is not None else None
    return Offer(sdp=sdp, voice=voice, instructions=instructions, resume_token=resume, ice=check_offer(sdp),
                 transcription=transcription, language=language)


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
        unknown = set(session) - {"voice", "instructions", "turn_detection", "output_modalities", "tools",
                                  "tool_choice", "parallel_tool_calls", "input_audio_transcription", "language"}
        if unknown:
            raise ProtocolError("unknown_parameter", f"session.{sorted(unknown)[0]} cannot be updated")
        given = {k: v for k, v in session.items() if v is not None}
        return SessionUpdate(
            voice=_voice(session.get("voice")),
            instructions=_instructions(session.get("instructions")),
            turn=_turn(session["turn_detection"], turn) if "turn_detection" in session else None,
            text_only=_text_only(session["output_modalities"]) if "output_modalities" in session else None,
            tools=_tools(given["tools"]) if "tools" in given else None,
            tool_choice=_tool_choice(given["tool_choice"]) if "tool_choice" in given else None,
            parallel_tool_calls=_flag(given["parallel_tool_calls"], "parallel_tool_calls")
            if "parallel_tool_calls" in given else None,
            transcription=transcription_setting(session["input_audio_transcription"],
                                                "session.input_audio_transcription")
            if "input_audio_transcription" in session else None,
            language=_language(session["language"], "session.language") if "language" in session else None,
        )
    if kind == "input_audio_buffer.commit":
        return Commit()
    if kind == "response.cancel":
        return CancelResponse()
    if kind == "conversation.item.create":
        return function_call_output(msg.get("item"))
    if kind == "response.create":
        return CreateResponse()
    raise ProtocolError("unknown_event", f"unknown message type {kind!r}")


def error_event(code: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message}}
