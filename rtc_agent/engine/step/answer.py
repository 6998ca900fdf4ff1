"""Answers in progress, and the batched step that advances all of them at once (one 80 ms frame each).

An answer starts with `CallContext.begin_answer` (the turn's tail, the assistant header, the first token and the
Talker's prefix, on one slot). From then on `tick` moves every answer forward together: for the answers that
speak, the code predictor's 15 steps for all of them, the Thinker's next token for all of them (on a side stream,
next to the rest), their Code2Wav frames (one step for the answers with as many frames before this one), then the
next Talker step for all of them; for the answers that only write (no Talker, or the speech ended before the
text), one Thinker token each. Each answer's events go out through its `emit` as soon as its frame is on the host.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..events import Event, ResponseDone, SpeechFrame, TextDelta
from ..scheduler.slots import SlotPool
from .graphs import rows_for, to_device
from .sampling import Sampling, gumbel_rows
from .tools import AnswerCalls, Constraint

FRAME_S = 0.08  # one codec frame of speech


class Answer:
    """One session's answer: what the batched step reads and advances for its slot's row."""

    def __init__(self, context, emit: Callable[[Event | Exception], None], started: float, header: list[int],
                 answer_start: int) -> None:
        self.context = context
        self.options = context.options
        self.emit = emit
        self.started = started
        self.header = header
        self.answer_start = answer_start  # the Thinker cache position where the assistant header begins
        self.tokens: list[int] = []  # generated text tokens, EOS excluded
        self.metrics: dict[str, float] = {}
        self.frames = 0
        self.frame_times: list[float] = []
        self.thinker_done = False  # the text is complete (EOS, or the length limit)
        self.ended_itself = False  # the Thinker ended it (<|im_end|>), no limit did
        self.speaking = False  # frames are still being made
        self.spoken = False  # the answer is spoken (the Talker makes its frames), not text only
        self.text_after_end = 0  # Talker steps fed since the text ended (tts_eos first, then tts_pad)
        self.interrupted_at: int | None = None  # frames the caller heard, once interrupted
        self.done = False
        self.first_frame_at: float | None = None
        self.step_started = started
        self.after: list[Callable[[], None]] = []  # run on the worker once the answer is done
        self.calls: AnswerCalls | None = None  # its function calls, when the session offers tools (tools.py)
        self.lock: Any = None  # its text's grammar state under the language lock (language.py), when there is one
        self.talker_behind: torch.Tensor | None = None  # its first frame's codes, while their Talker step waits

    @property
    def row(self) -> int:
        return self.context.slot.index

    def add_first_token(self, token: int) -> None:
        delta = self.take(token)
        self.metrics["ttft_ms"] = (time.perf_counter() - self.started) * 1e3
        if delta is not None:
            self.emit(delta)

    def take(self, token: int) -> TextDelta | None:
        """The Thinker's next token for this answer: <|im_end|> ends its text; a token of a function call goes to
        its calls (their events go out from there); returns the transcript's delta for a token of text."""
        if token == self.context.ids.im_end:
            self.thinker_done = self.ended_itself = True
            return None
        self.tokens.append(token)
        if self.calls is not None and not self.calls.take(token):
            return None
        if self.lock is not None and not self.lock.consume_token(token):
            raise RuntimeError(f"a token outside the language lock was drawn: {self.lock.get_error()}")
        return self._delta(token)

    @property
    def calling(self) -> bool:
        """A function call has opened: the rest of the answer is calls, which the Talker does not speak."""
        return self.calls is not None and self.calls.in_calls

    def constraint(self) -> Constraint | None:
        """What its next draw may take: its text's under the language lock, else `AnswerCalls.constraint`; None
        for any token."""
        if self.lock is not None and (self.calls is None or self.calls.matcher is None):  # (not in a call)
            return self.lock
        return self.calls.constraint() if self.calls is not None else None

    def _delta(self, token: int) -> TextDelta:
        return TextDelta(self.context.core.tokenizer.decode([token]), token)

    def interrupt(self, frames_played: int) -> None:
        """Stop within one frame; the history keeps the text of the first `frames_played` frames."""
        self.interrupted_at = max(0, frames_played)

    def lead_s(self, now: float) -> float:
        """Seconds of speech made ahead of real time: 0 before the first frame, infinite once nothing is spoken
        any more (text has no playout to keep up with)."""
        if not self.speaking:
            return math.inf
        if self.first_frame_at is None:
            return 0.0
        return self.frames * FRAME_S - (now - self.first_frame_at)

    @property
    def writes(self) -> bool:
        """Whether the next step gives this answer a text token without speech."""
        return (not self.done and not self.speaking and not self.thinker_done and self.interrupted_at is None
                and len(self.tokens) < self.options.max_answer_tokens)

    def end_speech(self) -> None:
        """The speech is over; at the length limit of a spoken answer its text stops too, but for a function call
        being written (a call is not spoken: it goes on to its end, within the token budget)."""
        self.speaking = False
        self.thinker_done = self.thinker_done or (self.frames >= self.options.max_frames and not self.calling)

    def ended(self) -> str:
        """Why the answer ended (`ResponseDone.ended`)."""
        if self.interrupted_at is not None:
            return "interrupted"
        if self.spoken and self.frames >= self.options.max_frames:
            return "max_output_duration"
        return "end" if self.ended_itself else "max_output_tokens"

    def finish(self) -> None:
        """Leave the caches holding the answer as the caller heard it (its text up to the cut, its complete calls)
        and send `ResponseDone`."""
        context = self.context
        interrupted = self.interrupted_at is not None
        speech = self.spoken
        text_end = self.calls.text_tokens if self.calling else len(self.tokens)
        text = self.tokens[:text_end]
        heard = text if not speech or not interrupted else text[:self.interrupted_at]
        calls = self.tokens[text_end:self.calls.complete_tokens] if self.calling else []
        self.done = True
        try:
            context.close_answer(self.answer_start, self.header, heard, calls, self.tokens, text if speech else None)
        finally:
            if self.frame_times:
                self.metrics["frame_ms_p50"] = float(np.percentile(self.frame_times, 50) * 1e3)
                self.metrics["frame_ms_p90"] = float(np.percentile(self.frame_times, 90) * 1e3)
            self.metrics["audio_s"] = self.frames * FRAME_S
            self.metrics["tokens"] = len(self.tokens)
            if self.calls is not None:
                self.metrics["grammar_ms"] = self.calls.spent_s * 1e3
                self.metrics["closing_tokens"] = self.calls.closing_tokens
            self.metrics["total_ms"] = (time.perf_counter() - self.started) * 1e3  # the whole answer made
            decoded = context.core.tokenizer.decode(heard)
            done = tuple(self.calls.done) if self.calls is not None else ()
            cut = self.calling and len(self.tokens) > self.calls.complete_tokens  # a call had begun, not ended
            self.emit(ResponseDone(decoded, tuple(heard), self.frames, interrupted, self.metrics, done, cut,
                                   self.ended()))


def tick(pool: SlotPool, answers: list[Answer]) -> None:
    """One step of every answer: a frame for those that speak, a token for those that only write; then every
    answer with nothing left to make is finished."""
    for answer in answers:
        if answer.speaking and answer.interrupted_at is not None:
            answer.end_speech()
    speak(pool, [a for a in answers if a.speaking])
    writing = [a for a in answers if a.writes]
    if writing:
        _start_tokens(pool, writing, overlap=False)
        tokens = pool.tokens()
        for a in writing:
            if (delta := a.take(tokens[a.row])) is not None:
                a.emit(delta)
    for answer in answers:
        if not answer.done and not answer.speaking and not answer.writes:
            answer.finish()


def speak(pool: SlotPool, answers: list[Answer], first: bool = False) -> None:
    """The next frame of each of `answers` (answers that speak), one batched step per sampling group. `first`:
    prepared answers' first frames (`FrameRequest`), made and sent without the Thinker token and the Talker step
    that lead to the second; each answer's first step makes them before its own (`_catch_up`)."""
    groups: dict[tuple[Sampling, ...], list[Answer]] = {}
    for answer in answers:
        groups.setdefault(_sampling_key(answer), []).append(answer)
    for group in groups.values():
        _frames(pool, group, first)


def _sampling_key(answer: Answer) -> tuple[Sampling, ...]:
    """Answers whose draws differ at most in `greedy` share one batched step (a greedy row draws with no noise)."""
    o = answer.options
    return tuple(replace(s, greedy=False) for s in (o.thinker_sampling, o.talker_sampling, o.predictor_sampling))


def _shared(group: list[Answer], name: str) -> Sampling:
    """The settings a group's batched draw runs under: greedy only if every answer is greedy."""
    settings = [getattr(a.options, name) for a in group]
    return settings[0] if all(s.greedy for s in settings) else replace(settings[0], greedy=False)


def _start_tokens(pool: SlotPool, answers: list[Answer], overlap: bool) -> None:
    """Queue the next Thinker token of `answers` (read with `pool.tokens()`); with `overlap` on the side stream."""
    rows: list = [None] * rows_for(max(a.row for a in answers), len(pool))
    samplings = [answers[0].options.thinker_sampling] * len(rows)
    constraints = {}
    for a in answers:
        rows[a.row] = (a.context.slot, a.tokens[-1], a.context.generator)
        samplings[a.row] = a.options.thinker_sampling
        if (constraint := a.constraint()) is not None:
            constraints[a.row] = constraint
    pool.start_tokens(rows, samplings, overlap, constraints)


def _frames(pool: SlotPool, group: list[Answer], first: bool = False) -> None:
    """One frame for each answer of `group` (answers that share their sampling settings); `first`: see `speak`."""
    talker = pool.talker
    talker_sampling, predictor_sampling = _shared(group, "talker_sampling"), _shared(group, "predictor_sampling")
    behind = [a for a in group if a.talker_behind is not None]
    if behind:
        _catch_up(pool, behind, talker_sampling)
    rows = rows_for(max(a.row for a in group), len(pool))
    members = {a.row: a for a in group}
    residual = (talker.config.num_code_groups - 1) * talker.residual_vocab
    noise = gumbel_rows(_draws(members, rows, "predictor_sampling"), residual, talker.device)
    codes = talker.frame_codes(rows, predictor_sampling, noise)
    code0 = talker.code0_values()
    going = []
    for a in group:
        if code0[a.row] == talker.config.codec_eos_token_id:  # the predictor's work on it is dropped
            a.end_speech()
        else:
            going.append(a)
    if not going:
        return
    ahead = [] if first else [a for a in going if not a.thinker_done]
    # On a GPU the Thinker's next token (for the frame after this one) runs on the side stream beside this frame's
    # Code2Wav. Without a side stream (the CPU) the step sends its frames first and makes the token after them:
    # every frame goes out that much sooner, the first one included (tiny model, 2-core CPU: the first packet
    # 51-66 -> 38-39 ms P50 after the turn's end), and each still one step after the one before.
    overlap = pool.side_stream is not None
    if ahead and overlap:
        _start_tokens(pool, ahead, overlap=True)
    pool.frame_codes.start(codes)
    pool.frame_samples.start(_speech(pool, rows, going, codes))
    if first or not overlap:
        _send_frames(pool, going)
    if ahead and not overlap:
        _start_tokens(pool, ahead, overlap=False)
    last = {a.row: a.frames + 1 >= a.options.max_frames for a in going}
    deltas: dict[int, TextDelta] = {}
    if first:
        for a in going:
            if not last[a.row]:
                a.talker_behind = codes[a.row].clone()
    else:
        deltas = _next_talker_step(pool, rows, members, codes, going, ahead, last, talker_sampling)
        if overlap:
            _send_frames(pool, going)
    for a in going:
        a.frames += 1
        if last[a.row] or a.interrupted_at is not None:
            a.end_speech()
        elif a.row in deltas:
            a.emit(deltas[a.row])


def _next_talker_step(pool: SlotPool, rows: int, members: dict[int, Answer], codes: torch.Tensor,
                      going: list[Answer], ahead: list[Answer], last: dict[int, bool],
                      sampling: Sampling) -> dict[int, TextDelta]:
    """Queue the Talker step after the frame of `codes` for the answers `going` on: its text input is the Thinker
    token queued for `ahead` (read here), or tts_eos once the text has ended, then tts_pad; none for an answer whose
    frame was its `last`. Returns the transcript's deltas, by row."""
    inputs = pool.core.talker_inputs
    tokens = pool.tokens() if ahead else []
    texts: dict[int, torch.Tensor | int] = {}  # row -> the Talker's text input: a token, or tts_eos / tts_pad
    deltas: dict[int, TextDelta] = {}
    for a in going:
        if a in ahead and not last[a.row]:  # at the frame limit the token goes unused (cropped with the answer)
            token = tokens[a.row]
            if (delta := a.take(token)) is not None:
                deltas[a.row] = delta
                # As in stock generate, the answer's last token (EOS, or the one at the length limit) is not
                # spoken: tts_eos takes its place. (So is none of a function call: its tokens go on without the
                # Talker, which ends its speech.)
                a.thinker_done = len(a.tokens) >= a.options.max_answer_tokens
                if not a.thinker_done:
                    texts[a.row] = token
            elif not a.thinker_done:
                a.thinker_done = len(a.tokens) >= a.options.max_answer_tokens
        if not last[a.row] and a.row not in texts:
            texts[a.row] = inputs.tts["eos"] if a.text_after_end == 0 else inputs.tts["pad"]
            a.text_after_end += 1
    if texts:
        _talker_step(pool, rows, members, codes, texts, sampling)
    return deltas


def _catch_up(pool: SlotPool, behind: list[Answer], sampling: Sampling) -> None:
    """The Thinker token and the Talker step that a first frame made in a preparation left for later (`speak`)."""
    rows = rows_for(max(a.row for a in behind), len(pool))
    codes = behind[0].talker_behind.new_zeros(rows, behind[0].talker_behind.shape[0])
    index = to_device(torch.tensor([a.row for a in behind]), codes.device)
    codes.index_copy_(0, index, torch.stack([a.talker_behind for a in behind]))
    ahead = [a for a in behind if not a.thinker_done]
    if ahead:
        _start_tokens(pool, ahead, overlap=False)
    deltas = _next_talker_step(pool, rows, {a.row: a for a in behind}, codes, behind, ahead,
                               {a.row: False for a in behind}, sampling)
    for a in behind:
        a.talker_behind = None
        if a.row in deltas:
            a.emit(deltas[a.row])


def _send_frames(pool: SlotPool, going: list[Answer]) -> None:
    """Each answer's frame of the step in progress, once its samples are on the host."""
    samples = pool.frame_samples.get()
    frame_codes = pool.frame_codes.get()
    for n, a in enumerate(going):
        now = time.perf_counter()
        if a.frames == 0:
            a.metrics["ttfp_ms"] = (now - a.started) * 1e3
            a.first_frame_at = now
        else:
            a.frame_times.append(now - a.step_started)
        a.emit(SpeechFrame(a.frames, samples[n].numpy().copy(), tuple(frame_codes[a.row].tolist())))
        a.step_started = time.perf_counter()


def _speech(pool: SlotPool, rows: int, going: list[Answer], codes: torch.Tensor) -> torch.Tensor:
    """Each answer's samples [len(going), 1920], from one Code2Wav step for them all."""
    befores: list[int | None] = [None] * rows
    for a in going:
        befores[a.row] = a.context.code2wav.frames_before
    batch = pool.code2wav.push(befores, codes)
    return torch.stack([batch[a.row] for a in going])


def _draws(members: dict[int, Answer], rows: int, name: str) -> list[torch.Generator | None]:
    """Each row's generator for a draw under its answer's `name` settings: None for a greedy answer's row and a
    row without an answer (their noise is zeros)."""
    return [a.context.generator if (a := members.get(r)) is not None and not getattr(a.options, name).greedy
            else None for r in range(rows)]


def _talker_step(pool: SlotPool, rows: int, members: dict[int, Answer], codes: torch.Tensor,
                 texts: dict[int, torch.Tensor | int], sampling: Sampling) -> None:
    """The next Talker step of the rows in `texts` (the others sit it out)."""
    talker, inputs = pool.talker, pool.core.talker_inputs
    token_rows = [r for r, t in texts.items() if isinstance(t, int)]
    projected = dict(zip(token_rows, inputs.text_input([[texts[r]] for r in token_rows]))) if token_rows else {}
    blank = inputs.tts["pad"].new_zeros(1, 1, inputs.tts["pad"].shape[-1])
    text = torch.cat([projected[r][None] if r in projected else texts.get(r, blank) for r in range(rows)])
    stepping = {r: a for r, a in members.items() if r in texts}
    noise = gumbel_rows(_draws(stepping, rows, "talker_sampling"), talker.vocab, talker.device)
    talker.step([r if r in texts else None for r in range(rows)], codes, text, sampling, noise)
