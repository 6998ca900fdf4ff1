"""Function calls on the built-in tiny model (random weights, so it babbles): every call it is made to write
parses and validates against its tool's schema, over many seeds and five kinds of schema; the call's events add
up to its arguments; the Talker speaks none of it; the history holds the call and the tool's response as Qwen3's
template writes them, and the conversation goes on from there."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest
import torch
from engine_helpers import caller_audio, engine_for, run

from rtc_agent.engine import ResponseDone, SessionOptions, SpeechFrame, TextDelta
from rtc_agent.engine.bench import BENCH_TOOLS
from rtc_agent.engine.events import ToolCallArguments, ToolCallDone, ToolCallStarted
from rtc_agent.engine.step.tools import DEFAULT_MAX_ITEMS, DEFAULT_MAX_STRING, AnswerCalls, Tool, ToolSet, bounded

TOOLS = BENCH_TOOLS
# schemas that leave strings and arrays open (no maxLength, maxItems): only the answer's budget bounds their calls
OPEN_TOOLS = (
    Tool.function("take_notes", "Write notes down.", {
        "type": "object", "properties": {"title": {"type": "string"},
                                         "lines": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "lines"]}),
    Tool.function("plan_trip", "Plan a trip.", {
        "type": "object", "properties": {"stops": {"type": "array", "items": {
            "type": "object", "properties": {"place": {"type": "string"},
                                             "tags": {"type": "array", "items": {"type": "string"}},
                                             "nights": {"type": "integer"}},
            "required": ["place", "tags", "nights"]}}},
        "required": ["stops"]}),
)
SCHEMAS = {tool.name: tool.schema for tool in TOOLS + OPEN_TOOLS}


async def _call(session, question: str) -> tuple[list, ResponseDone]:
    await session.push_text(question)
    events = [event async for event in session.respond()]
    return events[:-1], events[-1]


def _check(events: list, done: ResponseDone, named: str | None = None) -> None:
    """The answer is calls only, whole, valid; its events say the same as its ResponseDone."""
    assert not done.text and not done.call_cut and done.tool_calls
    assert not any(isinstance(e, (SpeechFrame, TextDelta)) for e in events)
    assert [e for e in events if isinstance(e, ToolCallDone)] == list(done.tool_calls)
    for call in done.tool_calls:
        assert named is None or call.name == named
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        started = [e for e in events if isinstance(e, ToolCallStarted) and e.index == call.index]
        pieces = "".join(e.delta for e in events if isinstance(e, ToolCallArguments) and e.index == call.index)
        assert [s.name for s in started] == [call.name] and pieces == call.arguments


def test_every_required_call_validates_across_seeds_and_schemas():
    """120 answers (each tool named, or "required" picking among all five; one in eight may make several calls),
    four sessions at once."""
    engine = engine_for(prefill_chunk_s=0)
    made: dict[str, int] = {}

    async def calls_on(seeds: range) -> None:
        for seed in seeds:
            named = TOOLS[seed % len(TOOLS)].name
            choice = named if seed % 3 else "required"
            tools = ToolSet(TOOLS, choice, parallel=seed % 8 == 0)
            session = engine.new_session(SessionOptions(seed=seed, speech=seed % 2 == 0, tools=tools))
            try:
                events, done = await _call(session, "Do it, please.")
                _check(events, done, None if choice == "required" else named)
                for call in done.tool_calls:
                    made[call.name] = made.get(call.name, 0) + 1
            finally:
                await session.close()

    async def all_calls() -> None:
        await asyncio.gather(*(calls_on(range(first, 120, 4)) for first in range(4)))

    run(all_calls(), timeout_s=600)
    assert sum(made.values()) >= 120 and set(made) == {tool.name for tool in TOOLS}


def test_a_call_always_ends_within_the_answers_budget_on_schemas_that_leave_strings_and_arrays_open():
    """120 answers with "required" (or a named tool) on the byte-level tiny model, ten sessions at once, budgets of
    70 to 110 tokens: the babbling model would run past any of them inside a string; every answer carries whole
    calls whose arguments validate, and it ends by itself (its <|im_end|>), not cut by the budget."""
    engine = engine_for(prefill_chunk_s=0)
    closed: list[float] = []  # each answer's tokens of the closing the budget forced

    async def calls_on(seeds: range) -> None:
        for seed in seeds:
            choice = ("required", *(t.name for t in OPEN_TOOLS))[seed % 3]
            options = SessionOptions(seed=seed, speech=False, max_answer_tokens=70 + seed % 41,
                                     tools=ToolSet(OPEN_TOOLS, choice, parallel=seed % 5 == 0))
            session = engine.new_session(options)
            try:
                events, done = await _call(session, "Note it all down.")
                _check(events, done, None if choice == "required" else choice)
                assert done.ended == "end" and done.metrics["tokens"] < options.max_answer_tokens
                closed.append(done.metrics["closing_tokens"])
            finally:
                await session.close()

    async def all_calls() -> None:
        await asyncio.gather(*(calls_on(range(first, 120, 10)) for first in range(10)))

    run(all_calls(), timeout_s=600)
    assert len(closed) == 120 and sum(c > 0 for c in closed) > 90  # (most would have been cut without it)


def _allowed(masks, constraint) -> np.ndarray:
    """The tokens `constraint` lets through, as `TokenMasks` computes its mask for a row."""
    host = torch.full((1, masks.words), -1, dtype=torch.int32)
    masks._fill(host, {0: constraint})
    return np.flatnonzero(np.unpackbits(host.numpy().view(np.uint8), bitorder="little"))


@pytest.mark.parametrize("choice", ["required", "plan_trip"])
def test_whatever_the_model_draws_a_call_closes_within_the_budget(choice):
    """The worst a model can do: 100 answers of draws at random among the tokens each mask allows, half of them
    picking tokens with `,`, `[`, `{` or `"` (which open what must be closed) whenever they may, budgets of 80 to
    250 tokens, with and without parallel calls: every answer's calls are whole and valid and end in time for its
    <|im_end|>."""
    engine = engine_for(prefill_chunk_s=0)
    runtime, masks = engine.tool_runtime, engine.pool.masks
    rng = np.random.default_rng(len(choice))
    openers = np.array([sum(c in b',[{"' for c in b) for b in runtime.bytes])
    freedom = []
    for answer in range(100):
        budget = int(rng.integers(80, 251))
        calls = AnswerCalls(runtime, ToolSet(OPEN_TOOLS + TOOLS, choice, parallel=answer % 3 == 0), budget,
                            lambda event: None)
        token, drawn = None, 0
        while token != runtime.special["end"]:
            assert drawn < budget
            allowed = _allowed(masks, calls.constraint())
            opening = allowed[openers[allowed] > 0]
            token = int(rng.choice(opening if answer % 2 and len(opening) else allowed))
            if token != runtime.special["end"]:
                calls.take(token)
                drawn += 1
        assert calls.done and calls.complete_tokens == drawn
        for call in calls.done:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        freedom.append(drawn - calls.closing_tokens)
    assert sum(f > 20 for f in freedom) > 50  # (the model drew freely for most of most answers)


def test_a_call_then_its_output_then_a_spoken_answer_with_the_history_as_the_template_writes_it():
    engine = engine_for(prefill_chunk_s=0)
    heating = TOOLS[0]
    session = engine.new_session(SessionOptions(seed=3, max_answer_tokens=200, max_frames=6,
                                                tools=ToolSet((heating,), "set_heating", parallel=False)))

    async def conversation():
        events, done = await _call(session, "Turn up the heating in the back seats, please.")
        session.update(tools=ToolSet((heating,), "auto"))
        await session.push_tool_output('{"ok": true}')
        answer = [event async for event in session.respond()]
        return done, answer, [engine.tokenizer.decode(s.ids) for s in session.context.segments]

    done, answer, history = run(conversation())
    assert len(done.tool_calls) == 1 and done.tool_calls[0].name == "set_heating"
    assert any(isinstance(e, SpeechFrame) for e in answer) and isinstance(answer[-1], ResponseDone)
    system, user, assistant, tool = history[:4]
    assert '{"type": "function", "function": {"name": "set_heating"' in system and "# Tools" in system
    assert assistant == (f'<|im_start|>assistant\n<tool_call>\n{{"name": "set_heating", "arguments": '
                         f'{done.tool_calls[0].arguments}}}\n</tool_call><|im_end|>\n')
    assert tool == '<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n'
    cache = session.context.cache
    assert cache.length == sum(len(s.ids) for s in session.context.segments)


def test_tool_choice_none_never_opens_a_call_and_auto_text_is_spoken():
    """With "none" the opening token is masked out of every draw; the answer is ordinary speech."""
    engine = engine_for(prefill_chunk_s=0)
    opener = engine.tool_runtime.special["open"]
    for seed in range(3):
        session = engine.new_session(SessionOptions(seed=seed, max_answer_tokens=30, max_frames=30,
                                                    tools=ToolSet(TOOLS, "none")))

        async def spoken():
            for start in range(0, 16000, 320):
                await session.push_audio(caller_audio(1.0, seed)[start:start + 320])
            return [event async for event in session.respond()]

        events = run(spoken())
        done = events[-1]
        assert opener not in done.token_ids and not done.tool_calls
        assert any(isinstance(e, SpeechFrame) for e in events)
        run(session.close())


def test_a_barge_in_during_a_call_drops_the_unfinished_call_and_keeps_the_context_consistent():
    engine = engine_for(prefill_chunk_s=0)
    session = engine.new_session(SessionOptions(seed=5, speech=False, tools=ToolSet(TOOLS[1:2], "add_to_list")))

    async def cut_call():
        await session.push_text("Add milk.")
        events = []
        async for event in session.respond():
            events.append(event)
            if isinstance(event, ToolCallArguments) and len(events) == 8:
                await session.cancel()
        return events

    events = run(cut_call())
    done = events[-1]
    assert done.interrupted and done.ended == "interrupted" and done.call_cut and not done.tool_calls
    assert not any(isinstance(e, ToolCallDone) for e in events)
    ids = engine.ids
    assert session.context.segments[-1].ids == [ids.im_start, ids.assistant, ids.newline, ids.im_end, ids.newline]
    assert session.context.cache.length == sum(len(s.ids) for s in session.context.segments)


@pytest.mark.parametrize("make, message", [
    (lambda: Tool.function("a b"), "name"),
    (lambda: Tool("x", "", "[1]"), "JSON Schema of an object"),
    (lambda: ToolSet((Tool.function("x"), Tool.function("x"))), "same name"),
    (lambda: ToolSet((Tool.function("x"),), "y"), "tool_choice"),
    (lambda: ToolSet((), "required"), "at least one tool"),
])
def test_bad_tools_are_refused_with_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_schema_llguidance_cannot_enforce_is_refused():
    with pytest.raises(ValueError, match="cannot be enforced"):
        ToolSet((Tool.function("x", "", {"type": "object", "properties": {"a": {"type": "strnig"}}}),))


def test_the_mask_is_the_grammar_applied_to_the_logits():
    """A row's mask, computed into the batch's staging buffer by llguidance's threads or for one draw, lets
    through exactly the tokens the grammar allows; the other rows keep every token."""
    engine = engine_for(prefill_chunk_s=0)
    masks, runtime = engine.pool.masks, engine.tool_runtime
    matcher = runtime.matcher(ToolSet(TOOLS, "set_timer"), opened=False)
    matcher.consume_tokens(engine.tokenizer.encode('<tool_call>\n{"name": "set_timer", "arguments": {"minutes": '))
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[:masks.words]
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:runtime.vocab])
    assert [engine.tokenizer.decode([t]) for t in allowed] == [str(d) for d in range(10)]
    with torch.inference_mode():  # (as on the engine's worker)
        sent = masks.send({1: matcher, 2: runtime.end_only})
    assert torch.equal(sent[1], torch.from_numpy(words.copy())) and bool((sent[0] == -1).all())
    assert torch.equal(masks.one(matcher)[0], sent[1])
    logits = torch.randn(3, runtime.vocab)
    out = masks.apply(logits, sent[:3])
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == list(allowed)
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [runtime.special["end"]]
    assert masks.send({}) is None


def test_with_auto_the_text_goes_on_until_the_model_opens_a_call_then_the_call_is_held_to_its_schema():
    """The path a real model takes with "auto": text, then <tool_call> drawn freely, then the call under the mask
    (draws made here at random among the allowed tokens: the tiny model itself practically never opens a call)."""
    engine = engine_for(prefill_chunk_s=0)
    runtime, tokenizer = engine.tool_runtime, engine.tokenizer
    rng = np.random.default_rng(0)
    for seed in range(10):
        events: list = []
        calls = AnswerCalls(runtime, ToolSet(TOOLS, "auto", parallel=seed % 2 == 0), 400, events.append)
        text = tokenizer.encode("Sure, one moment.")
        assert calls.constraint() is None and all(calls.take(t) for t in text)
        assert not calls.take(runtime.special["open"]) and calls.in_calls and calls.text_tokens == len(text)
        token = None
        while token != runtime.special["end"]:
            words = np.empty(engine.pool.masks.words, dtype=np.int32)
            constraint = calls.constraint()
            if isinstance(constraint, np.ndarray):
                words[:] = constraint
            else:
                words = np.frombuffer(constraint.compute_bitmask(), dtype=np.int32)[:len(words)]
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:runtime.vocab])
            token = int(rng.choice(allowed))
            if token != runtime.special["end"]:
                assert not calls.take(token)
        assert calls.done and len(calls.done) == len([e for e in events if isinstance(e, ToolCallStarted)])
        for call in calls.done:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            pieces = "".join(e.delta for e in events if isinstance(e, ToolCallArguments) and e.index == call.index)
            assert pieces == call.arguments


def test_what_a_schema_leaves_open_is_bounded_and_what_it_says_is_kept():
    schema = {"type": "object", "properties": {
        "note": {"type": ["string", "null"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 9}},
        "mode": {"enum": ["a", "b"]}, "inner": {"type": "object", "additionalProperties": True}}}
    assert bounded(schema) == {"type": "object", "additionalProperties": False, "properties": {
        "note": {"type": ["string", "null"], "maxLength": DEFAULT_MAX_STRING},
        "tags": {"type": "array", "maxItems": DEFAULT_MAX_ITEMS, "items": {"type": "string", "maxLength": 9}},
        "mode": {"enum": ["a", "b"]}, "inner": {"type": "object", "additionalProperties": True}}}
