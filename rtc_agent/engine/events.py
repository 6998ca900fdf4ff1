"""What the engine streams out of one answer: text deltas, 80 ms speech frames, function calls, and a closing
summary."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INPUT_SAMPLE_RATE = 16_000  # caller audio into the engine: mono float32
OUTPUT_SAMPLE_RATE = 24_000  # speech out of Code2Wav: mono float32
FRAME_SAMPLES = 1920  # one codec frame: 80 ms at 24 kHz


@dataclass(frozen=True)
class TextDelta:
    """A piece of the answer's transcript, as the Thinker writes it (one token)."""

    text: str
    token_id: int


@dataclass(frozen=True)
class SpeechFrame:
    """One 80 ms frame of the spoken answer: FRAME_SAMPLES float32 samples at OUTPUT_SAMPLE_RATE."""

    index: int
    samples: np.ndarray
    codes: tuple[int, ...]  # the 16 codebook ids this frame was decoded from


@dataclass(frozen=True)
class ResponseDone:
    """The answer is over: finished, cut by a limit, or interrupted (barge-in, cancel): `ended` says which."""

    text: str
    token_ids: tuple[int, ...]
    frames: int
    interrupted: bool
    metrics: dict[str, float] = field(default_factory=dict)  # ttfp_ms, ttft_ms, audio_s, frame_ms_p50, ...
    tool_calls: tuple["ToolCallDone", ...] = ()  # the answer's complete function calls (`text` is what precedes them)
    call_cut: bool = False  # a call was still being written when the answer stopped (cut, or out of tokens): dropped
    # "end" (the model ended it), "interrupted", or the limit that stopped it: "max_output_tokens" (the answer's
    # token budget, `max_answer_tokens`) or "max_output_duration" (a spoken answer's length, `max_frames`)
    ended: str = "end"


LIMITS = ("max_output_tokens", "max_output_duration")  # the `ended` of an answer a limit cut


@dataclass(frozen=True)
class ToolCallStarted:
    """The answer began a function call (`index`: its number in this answer, from 0); its name is written."""

    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """The next piece of a call's arguments (JSON text, as the Thinker writes it)."""

    index: int
    delta: str


@dataclass(frozen=True)
class ToolCallDone:
    """A whole call: its arguments parse and validate against the tool's parameters schema."""

    index: int
    name: str
    arguments: str


Event = TextDelta | SpeechFrame | ToolCallStarted | ToolCallArguments | ToolCallDone | ResponseDone
