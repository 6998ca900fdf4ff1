"""The conversation's typed events (rtc_agent/conversation_events.py): each one's JSON is the page's wire as
docs/api.md describes it, byte for byte (its keys in their order), and both protocols take every one of them."""
from __future__ import annotations

import json
from typing import Any

from rtc_agent import conversation_events as said
from rtc_agent.server.realtime import RealtimeEvents

CALL = said.FunctionCallMade("call_1", "get_weather", '{"city": "Paris"}')
METRICS = {"ttfp_ms": 120.5, "interrupted": False}
# one of each, and the JSON the page's `events` channel has carried for it
WIRE: list[tuple[said.ConversationEvent, dict[str, Any]]] = [
    (said.SpeechStarted(640, "item_1"),
     {"type": "input_audio_buffer.speech_started", "audio_start_ms": 640, "item_id": "item_1"}),
    (said.SpeechStopped(1600, "item_1"),
     {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 1600, "item_id": "item_1"}),
    (said.Committed("item_1"), {"type": "input_audio_buffer.committed", "item_id": "item_1"}),
    (said.Committed("item_1", ["Hello.", None]),
     {"type": "input_audio_buffer.committed", "item_id": "item_1", "transcripts": ["Hello.", None]}),
    (said.Cleared(None), {"type": "input_audio_buffer.cleared", "item_id": None}),
    (said.ResponseCreated("resp_1", False),
     {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress",
                                               "output_modalities": ["audio"]}}),
    (said.OutputAudioTranscriptDelta("resp_1", "Hi"),
     {"type": "response.output_audio_transcript.delta", "response_id": "resp_1", "delta": "Hi"}),
    (said.OutputTextDelta("resp_1", "Hi"), {"type": "response.output_text.delta", "response_id": "resp_1",
                                            "delta": "Hi"}),
    (said.OutputTextDone("resp_1", "Hi there."),
     {"type": "response.output_text.done", "response_id": "resp_1", "text": "Hi there."}),
    (said.FunctionCallArgumentsDelta("resp_1", "call_1", "get_weather", '{"ci'),
     {"type": "response.function_call_arguments.delta", "response_id": "resp_1", "call_id": "call_1",
      "name": "get_weather", "delta": '{"ci'}),
    (said.FunctionCallArgumentsDone("resp_1", "call_1", "get_weather", '{"city": "Paris"}'),
     {"type": "response.function_call_arguments.done", "response_id": "resp_1", "call_id": "call_1",
      "name": "get_weather", "arguments": '{"city": "Paris"}'}),
    (said.ResponseDone("resp_1", "incomplete", False, METRICS, "max_output_tokens", True, "Hi", (CALL,)),
     {"type": "response.done", "response": {
         "id": "resp_1", "status": "incomplete", "interrupted": False, "metrics": METRICS,
         "status_details": {"type": "incomplete", "reason": "max_output_tokens"}, "output_modalities": ["text"],
         "transcript": "Hi", "function_calls": [{"call_id": "call_1", "name": "get_weather",
                                                 "arguments": '{"city": "Paris"}'}]}}),
    (said.ResponseDone("resp_2", "cancelled", True, METRICS, None, False, "", ()),
     {"type": "response.done", "response": {
         "id": "resp_2", "status": "cancelled", "interrupted": True, "metrics": METRICS, "status_details": None,
         "output_modalities": ["audio"], "transcript": "", "function_calls": []}}),
    (said.ConversationState("speaking"), {"type": "conversation.state", "state": "speaking"}),
    (said.Error("out_of_memory", "CUDA out of memory"),
     {"type": "error", "error": {"type": "server_error", "code": "out_of_memory", "message": "CUDA out of memory"}}),
    (said.TranscriptionDelta("item_1", 0, "Hello"),
     {"type": "conversation.item.input_audio_transcription.delta", "item_id": "item_1", "content_index": 0,
      "delta": "Hello"}),
    (said.TranscriptionCompleted("item_1", 1, "Hello there."),
     {"type": "conversation.item.input_audio_transcription.completed", "item_id": "item_1", "content_index": 1,
      "transcript": "Hello there."}),
    (said.TranscriptionFailed("item_1", 0, "out of memory"),
     {"type": "conversation.item.input_audio_transcription.failed", "item_id": "item_1", "content_index": 0,
      "error": {"type": "transcription_error", "code": "recognizer_failed", "message": "out of memory"}}),
]


def _event_classes(base: type = said.ConversationEvent) -> list[type[said.ConversationEvent]]:
    """Every event class with a wire type (AnswerDelta, a base, has none)."""
    found = []
    for cls in base.__subclasses__():
        found += ([cls] if "type" in vars(cls) else []) + _event_classes(cls)
    return found


def test_each_event_is_sent_as_the_page_has_always_had_it() -> None:
    for event, wire in WIRE:
        assert json.dumps(event.as_json()) == json.dumps(wire), type(event).__name__


def test_every_event_has_its_own_type_its_wire_json_here_and_a_realtime_handler() -> None:
    classes = _event_classes()
    assert len({cls.type for cls in classes}) == len(classes)
    assert set(classes) == {type(event) for event, _ in WIRE}  # (a new event gets its line in WIRE)
    assert set(classes) == set(RealtimeEvents._from_conversation)  # (an event it lacks would fail on a call)
