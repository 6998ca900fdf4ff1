"""The events a call's conversation (and its captions) send, one frozen dataclass each, named after the OpenAI
Realtime event it is.

The server speaks two protocols over the same conversation: our page's data channel sends each event's
`as_json()` as it is, and the Realtime API's translator (server/realtime.py) builds the GA events from the typed
fields. Typed, a field added or renamed is checked where it is read instead of failing as a missing dict key
on a call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class ConversationEvent:
    type: ClassVar[str]  # its wire name

    def as_json(self) -> dict[str, Any]:
        """The event as the page's data channel sends it: its type, then its fields in their order."""
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclasses.dataclass(frozen=True)
class SpeechStarted(ConversationEvent):
    type = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str | None


@dataclasses.dataclass(frozen=True)
class SpeechStopped(ConversationEvent):
    type = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str | None


@dataclasses.dataclass(frozen=True)
class Committed(ConversationEvent):
    """The caller's turn is over; with captions on, `transcripts` has its parts' transcripts as they stand (None:
    on its way); with captions off it is None and left out of the JSON."""

    type = "input_audio_buffer.committed"
    item_id: str | None
    transcripts: list[str | None] | None = None

    def as_json(self) -> dict[str, Any]:
        fields = super().as_json()
        if self.transcripts is None:
            del fields["transcripts"]
        return fields


@dataclasses.dataclass(frozen=True)
class Cleared(ConversationEvent):
    type = "input_audio_buffer.cleared"
    item_id: str | None  # the turn dropped (None: there was none in progress)


def _modalities(text_only: bool) -> list[str]:
    return ["text"] if text_only else ["audio"]


@dataclasses.dataclass(frozen=True)
class ResponseCreated(ConversationEvent):
    type = "response.created"
    response_id: str
    text_only: bool

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "response": {"id": self.response_id, "status": "in_progress",
                                                "output_modalities": _modalities(self.text_only)}}


@dataclasses.dataclass(frozen=True)
class AnswerDelta(ConversationEvent):
    """A piece of an answer's text: one of the two below."""

    response_id: str
    delta: str


@dataclasses.dataclass(frozen=True)
class OutputAudioTranscriptDelta(AnswerDelta):
    """Of a spoken answer."""

    type = "response.output_audio_transcript.delta"


@dataclasses.dataclass(frozen=True)
class OutputTextDelta(AnswerDelta):
    """Of a written answer (output_modalities ["text"])."""

    type = "response.output_text.delta"


@dataclasses.dataclass(frozen=True)
class OutputTextDone(ConversationEvent):
    type = "response.output_text.done"
    response_id: str
    text: str


@dataclasses.dataclass(frozen=True)
class FunctionCallArgumentsDelta(ConversationEvent):
    type = "response.function_call_arguments.delta"
    response_id: str
    call_id: str
    name: str
    delta: str


@dataclasses.dataclass(frozen=True)
class FunctionCallArgumentsDone(ConversationEvent):
    type = "response.function_call_arguments.done"
    response_id: str
    call_id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class FunctionCallMade:
    """One of response.done's function_calls: a call whose arguments are whole."""

    call_id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ResponseDone(ConversationEvent):
    type = "response.done"
    response_id: str
    status: str  # completed, cancelled, incomplete (a limit cut it: `limit`) or failed
    interrupted: bool
    metrics: dict[str, Any]
    limit: str | None  # the limit that cut it (max_output_tokens, ...), where one did
    text_only: bool
    transcript: str
    function_calls: tuple[FunctionCallMade, ...]

    @property
    def status_details(self) -> dict[str, Any] | None:
        return {"type": "incomplete", "reason": self.limit} if self.status == "incomplete" else None

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "response": {
            "id": self.response_id, "status": self.status, "interrupted": self.interrupted, "metrics": self.metrics,
            "status_details": self.status_details, "output_modalities": _modalities(self.text_only),
            "transcript": self.transcript, "function_calls": [dataclasses.asdict(c) for c in self.function_calls]}}


@dataclasses.dataclass(frozen=True)
class ConversationState(ConversationEvent):
    type = "conversation.state"
    state: str  # listening, thinking, speaking or interrupted (conversation.State's values)


@dataclasses.dataclass(frozen=True)
class Error(ConversationEvent):
    """The server failed something of the call (an engine call, a video frame); the call goes on."""

    type = "error"
    kind: ClassVar[str] = "server_error"
    code: str
    message: str

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "error": {"type": self.kind, "code": self.code, "message": self.message}}


@dataclasses.dataclass(frozen=True)
class TranscriptionDelta(ConversationEvent):
    """Caption words of the caller's part `content_index` of the item (media/captions.py)."""

    type = "conversation.item.input_audio_transcription.delta"
    item_id: str
    content_index: int
    delta: str


@dataclasses.dataclass(frozen=True)
class TranscriptionCompleted(ConversationEvent):
    type = "conversation.item.input_audio_transcription.completed"
    item_id: str
    content_index: int
    transcript: str


@dataclasses.dataclass(frozen=True)
class TranscriptionFailed(ConversationEvent):
    type = "conversation.item.input_audio_transcription.failed"
    item_id: str
    content_index: int
    message: str

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "item_id": self.item_id, "content_index": self.content_index,
                "error": {"type": "transcription_error", "code": "recognizer_failed", "message": self.message}}
