"""The OpenAI Realtime API (GA) spoken over a call's conversation, for both transports.

`RealtimeEvents` is the one translator between a `Conversation` and a Realtime client, whether the client came
over WebRTC (`/v1/realtime/calls`, events on the `oai-events` data channel, audio over RTP) or over the
WebSocket (`/v1/realtime`, audio as base64 PCM16 in the events). It turns the conversation's events into the GA
server events (with an `event_id` each, and the item and response ids a Realtime client tracks) and the client's
events into conversation calls. What this server cannot do gets an `error` event, never silence.

The turn-taking, barge-in and engine underneath are the conversation's, the same as for our own page.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import secrets
from typing import Any, Callable, Literal

from ..config import TurnSettings
from .. import conversation_events as said
from ..conversation import Conversation, ConversationError
from ..engine.step.tools import ToolSet
from ..media.captions import Transcription
from ..media.outbound import PACKET_S
from ..media.pcm import PCM_RATE
from . import json_input
from .protocol import (ProtocolError, SessionUpdate, function_call_output, output_modalities, parse_client_message,
                       tool_description, transcription_description, transcription_setting, turn_description)

Transport = Literal["webrtc", "websocket"]
MAX_EVENT_BYTES = 8 * 1024 * 1024  # an append of ~2.5 minutes of audio
MAX_TEXT_CHARS = 8000
PCM_FORMAT = {"type": "audio/pcm", "rate": PCM_RATE}
# session fields a client may send with the one value this server has (sent by SDKs with their defaults)
FIXED = {
    "max_output_tokens": ("inf",),
    "truncation": ("auto",),
    "include": (None, []),
}
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")  # as our own session.update takes them
IGNORED = ("model", "tracing")  # one model here; tracing is OpenAI's dashboard, there is nothing to trace to


class RealtimeError(Exception):
    """A Realtime `error` event: bad or unsupported input; nothing changes."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def parse_json(text: str | bytes, what: str, param: str | None = None) -> Any:
    """Client JSON through the server's one parser (depth, constants, encoding); any problem is `invalid_json`."""
    try:
        return json_input.loads(text)
    except ProtocolError as exc:
        raise RealtimeError("invalid_json", f"{what}: {exc.message}", param) from None


def _unsupported(param: str, what: str) -> RealtimeError:
    return RealtimeError("unsupported_value", f"{param}: {what} is not supported by this server", param)


def _check_format(value: Any, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "audio/pcm" or value.get("rate", PCM_RATE) != PCM_RATE:
        raise _unsupported(param, f"{json.dumps(value)[:80]} (audio/pcm at {PCM_RATE} Hz is)")


def _turn_detection(value: Any, param: str) -> Any:
    """GA turn_detection -> ours: create_response and interrupt_response are always true here."""
    if not isinstance(value, dict):
        return value
    value = dict(value)
    for key in ("create_response", "interrupt_response"):
        if value.pop(key, True) is not True:
            raise _unsupported(f"{param}.{key}", "false")
    if value.pop("idle_timeout_ms", None) is not None:
        raise _unsupported(f"{param}.idle_timeout_ms", "an idle timeout")
    return value


def parse_session(session: Any, turn: TurnSettings) -> SessionUpdate:
    """A GA session object (session.update, a call's `session` part, a client secret's) -> our SessionUpdate.
    RealtimeError or ProtocolError for what cannot be applied."""
    if not isinstance(session, dict):
        raise RealtimeError("invalid_value", "session must be an object", "session")
    ours: dict[str, Any] = {}
    for key, value in session.items():
        param = f"session.{key}"
        if key == "type":
            if value != "realtime":
                raise _unsupported(param, repr(value))
        elif key == "instructions":
            ours["instructions"] = value
        elif key == "audio":
            ours.update(_audio(value, param))
        elif key == "output_modalities":
            if value not in (["audio"], ["text"]):
                raise _unsupported(param, f'{json.dumps(value)[:80]} (["audio"] or ["text"] is)')
            ours["output_modalities"] = value
        elif key in TOOL_KEYS:
            ours[key] = value
        elif key == "language":  # our extension: the language lock (docs/api.md, "Language lock")
            ours[key] = value
        elif key in FIXED:
            if value not in FIXED[key]:
                raise _unsupported(param, json.dumps(value)[:80])
        elif key not in IGNORED:
            raise RealtimeError("unknown_parameter", f"{param} is not supported by this server", param)
    return parse_client_message(json.dumps({"type": "session.update", "session": ours}), turn)


def _audio(audio: Any, param: str) -> dict[str, Any]:
    if not isinstance(audio, dict) or set(audio) - {"input", "output"}:
        raise RealtimeError("invalid_value", f"{param} takes input and output", param)
    for side in ("input", "output"):
        if not isinstance(audio.get(side) or {}, dict):
            raise RealtimeError("invalid_value", f"{param}.{side} must be an object", f"{param}.{side}")
    ours: dict[str, Any] = {}
    for key, value in (audio.get("input") or {}).items():
        p = f"{param}.input.{key}"
        if key == "format":
            _check_format(value, p)
        elif key == "transcription":
            transcription_setting(value, p)  # (checked here to name the Realtime API's field)
            ours["input_audio_transcription"] = value
        elif key == "noise_reduction":
            if value is not None:
                raise _unsupported(p, "anything but null")
        elif key == "turn_detection":
            ours["turn_detection"] = _turn_detection(value, p)
        else:
            raise RealtimeError("unknown_parameter", f"{p} is not supported by this server", p)
    for key, value in (audio.get("output") or {}).items():
        p = f"{param}.output.{key}"
        if key == "format":
            _check_format(value, p)
        elif key == "voice":
            ours["voice"] = value
        elif key == "speed":
            if value not in (None, 1, 1.0):
                raise _unsupported(p, "a speed other than 1")
        else:
            raise RealtimeError("unknown_parameter", f"{p} is not supported by this server", p)
    return ours


def session_object(session_id: str, model: Any, voice: str, instructions: str, turn: TurnSettings,
                   text_only: bool = False, tools: ToolSet = ToolSet(), language: str | None = None,
                   transcription: Transcription | None = None) -> dict[str, Any]:
    """The GA session object of session.created / session.updated and of a client secret (plus our `language`)."""
    detection = turn_description(turn)
    if detection is not None:
        detection = {**detection, "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}
    return {
        "type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
        "output_modalities": output_modalities(text_only), "instructions": instructions, **tool_description(tools),
        "language": language,
        "max_output_tokens": "inf", "tracing": None, "truncation": "auto", "prompt": None, "include": None,
        "audio": {
            "input": {"format": PCM_FORMAT, "transcription": transcription_description(transcription),
                      "noise_reduction": None,
                      "turn_detection": detection},
            "output": {"format": PCM_FORMAT, "voice": voice, "speed": 1.0},
        },
    }


@dataclasses.dataclass
class _Call:
    """One of a response's function calls: its `function_call` output item."""

    item_id: str
    output_index: int
    previous_item_id: str | None
    call_id: str
    name: str
    arguments: str = ""  # as much as has come
    done: bool = False  # the arguments are whole (a call cut before its end never is: the engine dropped it)

    def item(self, over: bool = False) -> dict[str, Any]:
        """Its item; `over`: its response is over (a call not done by then was cut)."""
        status = "completed" if self.done else ("incomplete" if over else "in_progress")
        return {"id": self.item_id, "object": "realtime.item", "type": "function_call", "status": status,
                "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


@dataclasses.dataclass
class _Response:
    id: str
    text_only: bool = False  # a written answer: output_text, not output_audio
    item_id: str | None = None  # its assistant message, opened by its first text or audio (a call has none)
    output_index: int = 0  # the message's
    previous_item_id: str | None = None  # the item before the message
    transcript: str = ""  # its text (the audio's transcript, or the written text)
    calls: dict[str, _Call] = dataclasses.field(default_factory=dict)  # by call_id, in order
    audio_started: bool = False
    cancel_reason: str = "turn_detected"

    @property
    def outputs(self) -> int:
        """Its output items so far (the next one's output_index)."""
        return (self.item_id is not None) + len(self.calls)

    def where(self) -> dict[str, Any]:
        """The fields that place an event in its message's one content part."""
        return {"response_id": self.id, "item_id": self.item_id, "output_index": self.output_index,
                "content_index": 0}


def _user_text(item: Any) -> str:
    """The text of a user message item of input_text parts."""
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") != "user":
        raise RealtimeError("unsupported_value", "only user messages and function_call_output items can be added",
                            "item")
    content = item.get("content")
    if not isinstance(content, list) or not content or not all(
            isinstance(c, dict) and c.get("type") == "input_text" and isinstance(c.get("text"), str)
            for c in content):
        raise RealtimeError("unsupported_value", "a user message here is input_text content", "item.content")
    text = "".join(c["text"] for c in content)
    if not text.strip() or len(text) > MAX_TEXT_CHARS:
        raise RealtimeError("invalid_value", f"the text must be 1 to {MAX_TEXT_CHARS} characters", "item.content")
    return text


class RealtimeEvents:
    """One Realtime client's side of a conversation. `send` puts an event on the transport."""

    def __init__(self, send: Callable[[dict[str, Any]], None], transport: Transport, session_id: str, model: Any,
                 voice: str, instructions: str) -> None:
        self._send = send
        self.transport = transport
        self.session_id = session_id
        self.model = model
        self.voice, self.instructions = voice, instructions
        self.conversation: Conversation | None = None
        self.on_audio: Callable[[bytes], None] | None = None  # input_audio_buffer.append (WebSocket only)
        self._ids = itertools.count(1)
        self._last_item: str | None = None  # the conversation's latest item
        self._responses: dict[str, _Response] = {}  # by id: a cut answer may still wind down as the next begins
        self._response: _Response | None = None  # the newest answer
        self._last_answer: str | None = None  # the latest answer's item (conversation.item.truncate names it)

    def bind(self, conversation: Conversation) -> None:
        self.conversation = conversation

    # ---- out ----------------------------------------------------------------------------------------------
    def emit(self, type_: str, **fields: Any) -> None:
        self._send({"type": type_, "event_id": f"event_{secrets.token_hex(8)}", **fields})

    def error(self, code: str, message: str, param: str | None = None, client_event: Any = None,
              kind: str = "invalid_request_error") -> None:
        self.emit("error", error={"type": kind, "code": code, "message": message, "param": param,
                                  "event_id": client_event if isinstance(client_event, str) else None})

    def opened(self) -> None:
        """The transport is up: session.created."""
        self.emit("session.created", session=self.description())

    def description(self) -> dict[str, Any]:
        return session_object(self.session_id, self.model, self.voice, self.instructions, self.conversation.turn,
                              self.conversation.text_only, self.conversation.tools,
                              language=self.conversation.session.options.language,
                              transcription=self.conversation.transcription)

    def apply(self, update: SessionUpdate) -> None:
        """A parsed session update (ProtocolError when the conversation refuses a value)."""
        try:
            self.conversation.update(update.voice, update.instructions, update.turn, update.text_only,
                                     update.tool_set(self.conversation.tools), language=update.language,
                                     transcription=update.transcription)
        except ValueError as exc:
            raise ProtocolError("invalid_value", str(exc)) from None
        self.voice = update.voice or self.voice
        self.instructions = update.instructions if update.instructions is not None else self.instructions

    def audio_frame(self, pcm: bytes) -> None:
        """One 80 ms frame of the current answer as PCM16 (WebSocket transport)."""
        r = self._response
        if r is None:
            return
        self._message(r)
        self.emit("response.output_audio.delta", **r.where(), delta=base64.b64encode(pcm).decode())

    def conversation_event(self, event: said.ConversationEvent) -> None:
        """The conversation's own events, as GA events (`_from_conversation` says which handler takes each)."""
        self._from_conversation[type(event)](self, event)

    def _speech_started(self, event: said.SpeechStarted) -> None:
        self.emit(event.type, audio_start_ms=event.audio_start_ms, item_id=event.item_id)

    def _speech_stopped(self, event: said.SpeechStopped) -> None:
        self.emit(event.type, audio_end_ms=event.audio_end_ms, item_id=event.item_id)

    def _committed(self, event: said.Committed) -> None:
        self.emit(event.type, previous_item_id=self._last_item, item_id=event.item_id)
        parts = event.transcripts or [None]  # (one input_audio content a part of the caller's speech)
        self._add_item({"id": event.item_id, "type": "message", "role": "user", "status": "completed",
                        "content": [{"type": "input_audio", "transcript": t} for t in parts]})

    def _cleared(self, event: said.Cleared) -> None:
        self.emit(event.type)

    def _created(self, event: said.ResponseCreated) -> None:
        self._response_created(event.response_id, event.text_only)

    def _output_delta(self, event: said.AnswerDelta) -> None:
        """response.output_audio_transcript.delta or response.output_text.delta."""
        r = self._responses.get(event.response_id)
        if r is not None:
            self._message(r)
            r.transcript += event.delta
            self.emit(event.type, **r.where(), delta=event.delta)

    def _call_arguments(self, event: said.FunctionCallArgumentsDelta | said.FunctionCallArgumentsDone) -> None:
        r = self._responses.get(event.response_id)
        if r is not None:
            self._call_event(r, event)

    def _done(self, event: said.ResponseDone) -> None:
        self._response_done(event)

    def _state(self, event: said.ConversationState) -> None:
        r = self._response
        if event.state == "speaking" and r is not None:
            self._message(r)
            if self.transport == "webrtc":
                r.audio_started = True
                self.emit("output_audio_buffer.started", response_id=r.id)

    def _conversation_error(self, event: said.Error) -> None:
        self.error(event.code, event.message, kind=event.kind)

    def _as_they_are(self, event: said.ConversationEvent) -> None:
        """The caller's transcription events: their fields as the page gets them."""
        fields = event.as_json()
        self.emit(fields.pop("type"), **fields)

    def _said_elsewhere(self, event: said.OutputTextDone) -> None:
        """response.output_text.done: said by `_response_done`, in its place among the response's closing
        events."""

    _from_conversation: dict[type[said.ConversationEvent], Callable[["RealtimeEvents", Any], None]] = {
        said.SpeechStarted: _speech_started,
        said.SpeechStopped: _speech_stopped,
        said.Committed: _committed,
        said.Cleared: _cleared,
        said.ResponseCreated: _created,
        said.OutputAudioTranscriptDelta: _output_delta,
        said.OutputTextDelta: _output_delta,
        said.FunctionCallArgumentsDelta: _call_arguments,
        said.FunctionCallArgumentsDone: _call_arguments,
        said.ResponseDone: _done,
        said.OutputTextDone: _said_elsewhere,
        said.ConversationState: _state,
        said.Error: _conversation_error,
        said.TranscriptionDelta: _as_they_are,
        said.TranscriptionCompleted: _as_they_are,
        said.TranscriptionFailed: _as_they_are,
    }

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self.session_id[-8:]}{next(self._ids):04d}"

    def _add_item(self, item: dict[str, Any]) -> None:
        self.emit("conversation.item.added", previous_item_id=self._last_item, item=item)
        self.emit("conversation.item.done", previous_item_id=self._last_item, item=item)
        self._last_item = item["id"]

    def _item(self, r: _Response, status: str) -> dict[str, Any]:
        content = {"type": "output_text", "text": r.transcript} if r.text_only else \
            {"type": "output_audio", "transcript": r.transcript}
        return {"id": r.item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
                "content": [content] if status != "in_progress" else []}

    @staticmethod
    def _part(r: _Response) -> dict[str, Any]:
        return {"type": "text", "text": r.transcript} if r.text_only else {"type": "audio", "transcript": r.transcript}

    def _response_object(self, r: _Response, status: str, **more: Any) -> dict[str, Any]:
        return {"id": r.id, "object": "realtime.response", "status": status, "status_details": None,
                "conversation_id": f"conv_{self.session_id}", "output_modalities": output_modalities(r.text_only),
                "max_output_tokens": "inf", "audio": {"output": {"format": PCM_FORMAT, "voice": self.voice}},
                "usage": None, "metadata": None, **more}

    def _response_created(self, response_id: str, text_only: bool) -> None:
        r = self._response = self._responses[response_id] = _Response(response_id, text_only)
        self._last_answer = None  # until its message opens
        self.emit("response.created", response=self._response_object(r, "in_progress", output=[]))

    def _open_item(self, r: _Response, item: dict[str, Any], output_index: int) -> None:
        """A new output item of `r`, at the conversation's end."""
        self.emit("response.output_item.added", response_id=r.id, output_index=output_index, item=item)
        self.emit("conversation.item.added", previous_item_id=self._last_item, item=item)
        self._last_item = item["id"]

    def _close_item(self, r: _Response, item: dict[str, Any], output_index: int, previous_item_id: str | None
                    ) -> None:
        self.emit("response.output_item.done", response_id=r.id, output_index=output_index, item=item)
        self.emit("conversation.item.done", previous_item_id=previous_item_id, item=item)

    def _message(self, r: _Response) -> None:
        """Opens the response's assistant message, if it is not open yet."""
        if r.item_id is not None:
            return
        r.output_index, r.previous_item_id = r.outputs, self._last_item
        r.item_id = self._last_answer = self._new_id("item")
        self._open_item(r, self._item(r, "in_progress"), r.output_index)
        self.emit("response.content_part.added", **r.where(), part=self._part(r))

    def _call_event(self, r: _Response, event: said.FunctionCallArgumentsDelta | said.FunctionCallArgumentsDone
                    ) -> None:
        """The conversation's `response.function_call_arguments.delta` or `.done`: the call's item opens with its
        first piece and is done with its arguments."""
        call = r.calls.get(event.call_id)
        if call is None:
            call = _Call(self._new_id("item"), r.outputs, self._last_item, event.call_id, event.name)
            r.calls[call.call_id] = call
            self._open_item(r, call.item(), call.output_index)
        where = {"response_id": r.id, "item_id": call.item_id, "output_index": call.output_index,
                 "call_id": call.call_id}
        if isinstance(event, said.FunctionCallArgumentsDelta):
            call.arguments += event.delta
            self.emit(event.type, **where, delta=event.delta)
            return
        call.arguments, call.done = event.arguments, True
        self.emit(event.type, **where, name=call.name, arguments=call.arguments)
        self._close_item(r, call.item(), call.output_index, call.previous_item_id)

    def _response_done(self, done: said.ResponseDone) -> None:
        r = self._responses.pop(done.response_id, None)
        if r is None:
            return
        if self._response is r:
            self._response = None
        status = done.status
        output: dict[int, dict[str, Any]] = {}
        if r.item_id is not None:
            where = r.where()
            if r.text_only:
                self.emit("response.output_text.done", **where, text=r.transcript)
            else:
                if self.transport == "websocket":
                    self.emit("response.output_audio.done", **where)
                self.emit("response.output_audio_transcript.done", **where, transcript=r.transcript)
            self.emit("response.content_part.done", **where, part=self._part(r))
            output[r.output_index] = self._item(r, "completed" if status == "completed" else "incomplete")
            self._close_item(r, output[r.output_index], r.output_index, r.previous_item_id)
        for call in r.calls.values():
            output[call.output_index] = call.item(over=True)
            if not call.done:  # cut while it was being written: it is not in the conversation
                self._close_item(r, output[call.output_index], call.output_index, call.previous_item_id)
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": r.cancel_reason}
        elif status == "failed":
            details = {"type": "failed", "error": {"type": "server_error", "code": "engine_error"}}
        elif status == "incomplete":  # a limit cut it: {"type": "incomplete", "reason": "max_output_tokens" or ...}
            details = done.status_details
        response = self._response_object(r, status, output=[output[i] for i in sorted(output)],
                                         metrics=done.metrics)
        response["status_details"] = details
        self.emit("response.done", response=response)
        if self.transport == "webrtc" and r.audio_started:
            self.emit("output_audio_buffer.cleared" if done.interrupted else "output_audio_buffer.stopped",
                      response_id=r.id)

    # ---- in -----------------------------------------------------------------------------------------------
    def receive(self, text: Any) -> None:
        """One client event (a text frame); errors become `error` events."""
        event_id = None
        try:
            if not isinstance(text, str) or len(text) > MAX_EVENT_BYTES:
                raise RealtimeError("invalid_json", "events are JSON text of at most 8 MiB")
            event = parse_json(text, "the event is not JSON")
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeError("invalid_json", 'an event is a JSON object with a "type"')
            event_id = event.get("event_id")
            handler = self._handlers.get(event["type"])
            if handler is None:
                raise RealtimeError("unknown_event", f"{event['type'][:100]!r} is not supported by this server",
                                    "type")
            handler(self, event)
        except (RealtimeError, ProtocolError) as exc:
            self.error(exc.code, exc.message, exc.param, event_id)
        except ConversationError as exc:
            self.error(exc.code, exc.message, None, event_id)

    def _session_update(self, event: dict[str, Any]) -> None:
        self.apply(parse_session(event.get("session"), self.conversation.turn))
        self.emit("session.updated", session=self.description())

    def _append(self, event: dict[str, Any]) -> None:
        if self.on_audio is None:
            raise RealtimeError("unsupported_event", "on a WebRTC call the caller's audio comes over RTP", "type")
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError("invalid_value", "audio must be base64 PCM16", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("invalid_value", "audio is not valid base64", "audio") from None
        self.on_audio(data)

    def _commit(self, event: dict[str, Any]) -> None:
        self.conversation.commit(respond=False)

    def _clear(self, event: dict[str, Any]) -> None:
        self.conversation.clear_input()

    def _item_create(self, event: dict[str, Any]) -> None:
        """A user message of input_text, or a function_call_output."""
        if event.get("previous_item_id") not in (None, self._last_item):
            raise _unsupported("previous_item_id", "inserting before the conversation's end")
        item = event.get("item")
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            output = function_call_output(item)
            self.conversation.add_tool_output(output.call_id, output.output)
            added = {"type": "function_call_output", "call_id": output.call_id, "output": output.output}
        else:
            text = _user_text(item)
            self.conversation.add_text(text)
            added = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        item_id = item["id"] if isinstance(item.get("id"), str) else self._new_id("item")
        self._add_item({"id": item_id[:64], "object": "realtime.item", **added, "status": "completed"})

    def _response_create(self, event: dict[str, Any]) -> None:
        params = event.get("response") or {}
        if not isinstance(params, dict):
            raise RealtimeError("invalid_value", "response must be an object", "response")
        tools = tool_description(self.conversation.tools)
        for key, value in params.items():
            if key == "conversation" and value == "auto" or key in FIXED and value in FIXED[key] or \
                    key in TOOL_KEYS and value == tools[key]:
                continue  # (the session's own)
            raise _unsupported(f"response.{key}", "a per-response setting")
        self.conversation.create_response()

    def _response_cancel(self, event: dict[str, Any]) -> None:
        r = self._response
        wanted = event.get("response_id")
        if wanted is not None and (r is None or wanted != r.id):
            raise RealtimeError("response_cancel_not_active", f"{str(wanted)[:64]} is not the active response",
                                "response_id")
        if r is not None:
            r.cancel_reason = "client_cancelled"
        self.conversation.cancel_response()

    def _output_clear(self, event: dict[str, Any]) -> None:
        if self.transport != "webrtc":
            raise RealtimeError("unsupported_event", "output_audio_buffer.clear is for WebRTC calls", "type")
        r = self._response
        if r is not None:
            r.cancel_reason = "client_cancelled"
            try:
                self.conversation.cancel_response()  # its response.done says output_audio_buffer.cleared
            except ConversationError:
                pass  # already cut (a response.cancel came first): its audio is being cleared

    def _truncate(self, event: dict[str, Any]) -> None:
        item_id, end_ms = event.get("item_id"), event.get("audio_end_ms")
        if item_id is None or item_id != self._last_answer:
            raise RealtimeError("invalid_value", "only the latest answer's item can be truncated", "item_id")
        if event.get("content_index", 0) != 0:
            raise RealtimeError("invalid_value", "an answer has one content part (index 0)", "content_index")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise RealtimeError("invalid_value", "audio_end_ms must be a whole number >= 0", "audio_end_ms")
        self.conversation.truncate_answer(int(end_ms / 1000 / PACKET_S))
        self.emit("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end_ms)

    _handlers: dict[str, Callable[["RealtimeEvents", dict[str, Any]], None]] = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
        "output_audio_buffer.clear": _output_clear,
        "conversation.item.truncate": _truncate,
    }

