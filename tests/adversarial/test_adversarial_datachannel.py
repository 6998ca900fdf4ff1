"""Bad data-channel messages on a live call: each gets an `error` event, changes nothing, and the call goes on
(the connection stays up and the next turn is answered)."""
from __future__ import annotations

import json

import pytest

from rtc_support import caller, needs_espeak, run, say, server
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(180)]

DEEP = 20_000


def update(**session: object) -> str:
    return json.dumps({"type": "session.update", "session": session})


def item(value: object) -> str:
    return json.dumps({"type": "conversation.item.create", "item": value})


BAD = [  # (what, message as sent, expected error code)
    ("NaN", '{"type": "session.update", "session": {"turn_detection": {"silence_duration_ms": NaN}}}',
     "invalid_json"),
    ("Infinity", '{"type": "session.update", "session": {"turn_detection": {"silence_duration_ms": Infinity}}}',
     "invalid_json"),
    ("-Infinity as a threshold", '{"type": "session.update", "session": {"turn_detection": {"threshold": -Infinity}}}',
     "invalid_json"),
    ("1e400 (infinite as a float)", '{"type": "session.update", "session": {"turn_detection": {"threshold": 1e400}}}',
     "invalid_value"),
    ("a 401-digit integer", update(turn_detection={"silence_duration_ms": int("9" * 401)}), "invalid_value"),
    ("a 401-digit threshold", update(turn_detection={"threshold": int("9" * 401)}), "invalid_value"),
    ("JSON nested 20 000 deep", '{"type": "session.update", "session": ' + "[" * DEEP + "]" * DEEP + "}",
     "invalid_json"),
    ("a lone surrogate in instructions", update(instructions="be brief \ud800"), "invalid_value"),
    ("a lone low surrogate", update(instructions="\udfff"), "invalid_value"),
    ("instructions too long", update(instructions="x" * 9000), "invalid_value"),
    ("a voice that is a list", update(voice=["ethan"]), "invalid_value"),
    ("turn_detection a string", update(turn_detection="server_vad"), "invalid_value"),
    ("an unknown turn setting", update(turn_detection={"eagerness_x": 1}), "unknown_parameter"),
    ("a boolean duration", update(turn_detection={"silence_duration_ms": True}), "invalid_value"),
    ("a negative duration", update(turn_detection={"silence_duration_ms": -5}), "invalid_value"),
    ("not JSON", "{oops", "invalid_json"),
    ("a JSON string", '"session.update"', "invalid_json"),
    ("type not a string", '{"type": 7}', "invalid_json"),
    ("an unknown event", '{"type": "conversation.item.delete"}', "unknown_event"),
    ("an item create without an item", '{"type": "conversation.item.create"}', "invalid_value"),
    ("a user message item", item({"type": "message", "role": "user", "content": []}), "invalid_value"),
    ("an output for no call", item({"type": "function_call_output", "call_id": "call_0", "output": ""}),
     "invalid_value"),
    ("an output that is not text", item({"type": "function_call_output", "call_id": "call_0", "output": [1]}),
     "invalid_value"),
    ("an output too long", item({"type": "function_call_output", "call_id": "call_0", "output": "x" * 9000}),
     "invalid_value"),
    ("a response with nothing new to answer", '{"type": "response.create"}', "response_create_empty"),
    ("a tool of another type", update(tools=[{"type": "web_search"}]), "unsupported_value"),
    ("tools not a list", update(tools={"type": "function", "name": "f"}), "invalid_value"),
    ("a tool without a name", update(tools=[{"type": "function"}]), "invalid_value"),
    ("a tool's name with a space", update(tools=[{"type": "function", "name": "turn up"}]), "invalid_value"),
    ("a tool's field of another kind", update(tools=[{"type": "function", "name": "f", "strict": True}]),
     "unknown_parameter"),
    ("parameters not an object schema", update(tools=[{"type": "function", "name": "f", "parameters": {
        "type": "string"}}]), "invalid_value"),
    ("parameters llguidance cannot enforce", update(tools=[{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}]), "invalid_value"),
    ("a lone surrogate in a tool", update(tools=[{"type": "function", "name": "f", "description": "\ud800"}]),
     "invalid_value"),
    ("two tools of one name", update(tools=[{"type": "function", "name": "f"}] * 2), "invalid_value"),
    ("65 tools", update(tools=[{"type": "function", "name": f"f{i}"} for i in range(65)]), "invalid_value"),
    ("tool_choice naming no tool", update(tool_choice={"type": "function", "name": "f"}), "invalid_value"),
    ("tool_choice required with no tools", update(tool_choice="required"), "invalid_value"),
    ("tool_choice misspelt", update(tool_choice="requried"), "invalid_value"),
    ("parallel_tool_calls a string", update(parallel_tool_calls="yes"), "invalid_value"),
    ("session not an object", '{"type": "session.update", "session": 3}', "invalid_value"),
    ("more than 64 KiB", json.dumps({"type": "x", "pad": "p" * 70_000}), "invalid_json"),
    ("binary", b"\x00\x01\x02 binary", "invalid_json"),
    ("commit with nothing said", '{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty"),
    ("cancel with no answer", '{"type": "response.cancel"}', "response_cancel_not_active"),
]


def test_bad_messages_get_an_error_event_change_nothing_and_the_call_goes_on() -> None:
    async def main() -> None:
        async with server() as (url, app), caller(url) as (call, mic):
            created = (await call.next_event("session.created", timeout_s=10))["session"]
            for what, message, code in BAD:
                call.channel.send(message)
                err = (await call.next_event("error", timeout_s=10))["error"]
                assert err["code"] == code, (what, err)
                assert call.pc.connectionState == "connected", what
            call.channel.send(update())  # an empty update answers with the session as it is
            unchanged = (await call.next_event("session.updated", timeout_s=10))["session"]
            assert unchanged == created
            await say(call, mic)
            done = (await call.next_event("response.done", timeout_s=30))["response"]
            assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
            assert len(call.events_of("error")) == len(BAD)  # nothing else went wrong, no engine_error

    run(main(), timeout_s=150)
