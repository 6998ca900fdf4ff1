"""The scheduling policy in one place: what a session's turn work asks the worker for, in what order a round runs
it, which work goes first, and how much lead a playing answer keeps. worker.py says how it is carried out.

A session's turn work (`CallContext`) is a generator that yields requests; the worker gathers the requests of every
session into one round and runs it stage by stage, in `REQUEST_STAGES` order, each stage one batched pass over its
requests (`StageRunner`, stages.py):

1. `AudioRequest`: caller audio to encode (one pass of the audio encoder);
2. `PrefillRequest`: a short Thinker prefill at the end of a slot's context (one batched prefill);
3. `TokenRequest`: an answer's first token (one lm_head, one draw);
4. `TalkerPrefillRequest`: a short Talker prefill, a user part or an answer's assistant prefix;
5. `FrameRequest`: a prepared answer's first frame (one batched step for all of them).

A request's own docstring says what the worker sends back for it. This module imports nothing heavy at run time: a
media process reads `PREPARE_AFTER_SILENCE_MS` from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..step.answer import Answer
    from ..step.sampling import Sampling
    from ..step.talker import CodeDraw, TalkerRow
    from .slots import Slot

# Which job runs first: urgent ones (an answer's start or preparation, and the caller audio just before a
# preparation: a caller is waiting for the first packet) before the rest, each kind in the order asked.
URGENT, NORMAL = 0, 1
MIN_LEAD_S = 0.24  # three frames: below this an answer's next frame goes before any job
JOB_SLICE_S = 0.01  # job time between two steps even when an answer is close to its deadline
# Below this lead an answer that is playing gets its next frame before the next stage of a round, not after the
# round: a stage at 24 rows takes up to 40 ms (the Thinker prefill), a whole round of 21-24 preparations ~95 ms on
# the H200, more than the 80 ms of lead an answer has after its first frame. Two answers that started just before
# such a round were 18 ms late (a server's first burst of 24, `studies/device_loadtest.sh`).
CRITICAL_LEAD_S = 0.05
PREPARE_AFTER_SILENCE_MS = 160  # a call server prepares the answer after a pause this long (commas pause 96-160 ms)


@dataclass
class AudioRequest:
    """A stretch of caller audio to encode: the worker encodes the requests of several sessions in one pass
    (`audio_input.encode`) and sends back each one's output."""

    samples: np.ndarray  # 16 kHz float32 mono (the round makes every request's log-mel at once: `LogMel.many`)


@dataclass
class PrefillRequest:
    """A short Thinker prefill at the end of one slot's context (`graphs.short_prefill_fits`): the worker runs the
    requests of several sessions as one batched step (`SlotPool.prefill`) and sends back (hidden, captured)."""

    slot: Slot
    embeds: torch.Tensor  # [1, T, hidden]


@dataclass
class TokenRequest:
    """The first token of an answer, chosen from the Thinker's hidden state at the end of its prefill (`hidden`
    [1, hidden] or [1, 1, hidden]) under the session's sampling with its slot's generator; `allowed`: the tokens a
    function call's grammar lets it start with (`TokenMasks` words [1, words]; None: any). The worker chooses the
    tokens of every session in a round at once (`SlotPool.first_tokens`: one lm_head, one draw, one copy back)
    and sends back a `FirstToken`."""

    hidden: torch.Tensor
    sampling: Sampling
    generator: torch.Generator
    allowed: torch.Tensor | None = None
    talker_prefix: torch.Tensor | None = None  # where the Talker may speak it: its voice's `TalkerInputs.answer_prefix`


@dataclass
class TalkerPrefillRequest:
    """A short Talker prefill at the end of one slot's Talker context (`graphs.short_prefill_fits`): a user part,
    or an answer's assistant prefix. The worker runs those of several sessions as one batched step
    (`Talker.prefill`) and sends back (hidden, logits)."""

    row: TalkerRow
    embeds: torch.Tensor  # [1, T, hidden]
    draw: CodeDraw | None = None  # an answer's prefix: its first code 0 is chosen after it (`Talker.first_codes`)


@dataclass(frozen=True)
class FrameRequest:
    """A prepared answer's first frame (`CallContext.prepare_answer`): the worker makes the first frames of every
    answer prepared in a round in one batched step (`answer.speak`), the last stage of the round. Only the frame: on
    the H200 the stage took 42 ms for 24 answers with the Thinker token and Talker step for their second frames,
    which every one of them waited for before its first could go out; their first step makes those, as it would
    have waited for this stage's anyway (the stage 42 -> 11 ms of GPU for 24 answers; docs/performance.md, "Many
    callers at once")."""

    answer: Answer


Request = AudioRequest | PrefillRequest | TokenRequest | TalkerPrefillRequest | FrameRequest
REQUEST_STAGES = (AudioRequest, PrefillRequest, TokenRequest, TalkerPrefillRequest, FrameRequest)
