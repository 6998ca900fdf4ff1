"""One session's model-side state: the Thinker's KV cache holding the conversation, the Talker's user context,
the streaming Code2Wav, and the turn in progress. Everything here runs on the engine's worker thread."""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from ..errors import TurnTooLongError
from ..events import INPUT_SAMPLE_RATE, Event
from ..model.memory import release_cached
from ..model.stack import explicit_positions
from ..model.token_ids import TokenIds
from ..options import SessionOptions
from ..scheduler.policy import AudioRequest, FrameRequest, PrefillRequest, Request, TokenRequest
from ..scheduler.slots import Slot
from ..step import audio_input, vision_input
from ..step.answer import Answer
from ..step.graphs import short_prefill_fits, to_device
from ..step.talker import UserPart
from ..step.tools import AnswerCalls, system_text
from .caller_video import CallerVideo
from .layout import Piece, TurnLayout

if TYPE_CHECKING:
    from .engine import Engine  # the engine's model, options and pool (an import cycle at run time)


@dataclass
class Segment:
    """A piece of the conversation as the Thinker's cache holds it, kept so the cache can be rebuilt."""

    role: str  # system | user | assistant
    ids: list[int]
    positions: np.ndarray | None = None  # [3, len(ids)] rotary positions from the segment's first; None: sequential
    audio: list[torch.Tensor] = field(default_factory=list)  # encoder output for the audio placeholders, in order
    grids: list[vision_input.VisionGrid] = field(default_factory=list)  # video seconds, in order
    talker_part: torch.Tensor | None = None  # user turns: the Talker's input embeddings for this segment

    def extend(self, piece: Piece, positions: np.ndarray, count: int) -> None:
        """Add the first `count` ids of a prefilled piece, at `positions` (its position array); the rest belongs
        to the next segment."""
        self.ids += piece.ids[:count]
        positions = positions[:, :count]
        self.positions = positions if self.positions is None else np.concatenate((self.positions, positions), 1)
        self.audio += piece.audio
        self.grids += piece.grids

    def drop_oldest_grid(self, video_id: int) -> None:
        """Take the oldest video second out; every other token keeps its position."""
        grid = self.grids.pop(0)
        video = np.flatnonzero(np.array(self.ids) == video_id)[:grid.tokens]
        keep = np.ones(len(self.ids), dtype=bool)
        keep[video] = False
        self.ids = [t for t, k in zip(self.ids, keep) if k]
        self.positions = self.positions[:, keep]
        if self.talker_part is not None:
            self.talker_part = self.talker_part[:, torch.from_numpy(keep).to(self.talker_part.device)]


@dataclass
class Turn:
    """The caller's turn while it is being prefilled."""

    segment: Segment
    layout: TurnLayout
    start_at: float  # media-clock time of its first audio sample
    base: int = 0  # rotary position of its first token in the Thinker
    talker_base: int = 0  # and in the Talker
    frames: list = field(default_factory=list)  # the video frames it took, given back if the turn is dropped


@dataclass
class Prepared:
    """An answer made ready at a pause in the caller's turn (`CallContext.prepare_answer`), its events held until
    the turn ends, and what undoes it if the caller goes on instead."""

    answer: Answer
    events: list[Event]
    turn: Turn  # the turn as it was before its end was prefilled
    pending: np.ndarray  # the audio not yet prefilled before (the answer's prefill took it in; an undo gives it back)
    cache_length: int  # the Thinker cache's length before (the turn's end is sequential text: a crop undoes it)
    talker_length: int | None  # the Talker's user context before
    generator: torch.Tensor  # the slot's random state before the answer's first draws
    ready_at: float  # time.perf_counter() when it was ready


T = TypeVar("T")
Prefilling = Generator[Request, Any, T]  # see `CallContext`


class CallContext:
    """One call's context in its session slot: the conversation so far (kept so the cache can be rebuilt), the
    caller's turn being prefilled, and the start and end of each answer (`begin_answer`, `close`).

    The methods that take in the caller's turn (`add_audio`, `flush`, `prepare_answer`, `begin_answer`) are
    generators: each stretch of audio to encode is yielded as an `AudioRequest`, each short Thinker prefill as a
    `PrefillRequest`, an answer's first token as a `TokenRequest`, each short Talker prefill (a user part, an
    answer's prefix) as a `TalkerPrefillRequest` and a prepared answer's first frame as a `FrameRequest`, and the
    worker sends back the result once it has run it, batched with the requests of other sessions that came at the
    same moment (`StageRunner`, scheduler/stages.py). The worker drives them; `run_now` drives one here and now."""

    def __init__(self, core: Engine, slot: Slot, options: SessionOptions) -> None:
        self.core = core
        self.slot = slot
        self.options = options
        self.ids: TokenIds = core.ids
        slot.reset(options.seed)
        self.cache = slot.cache
        self.talker = slot.talker
        self.code2wav = slot.code2wav
        self.generator = slot.generator
        self.segments: list[Segment] = []
        # the latest spoken answer: (its cache position, its text tokens, its function calls' tokens)
        self._last_answer: tuple[int, list[int], list[int]] | None = None
        self.turn: Turn | None = None  # the user turn being prefilled
        self.prepared: Prepared | None = None  # an answer made ready at a pause (`prepare_answer`)
        self.pending = np.zeros(0, dtype=np.float32)  # caller audio not yet encoded
        self.typed: list[int] = []  # text ids the caller typed in this turn (they follow its audio)
        self.audio_clock = 0.0  # media-clock time just after the last audio pushed
        self._turn_start_at = 0.0  # media-clock time of the first sample of the turn being pushed
        vision = core.model.config.thinker_config.vision_config
        self.video = CallerVideo(vision.patch_size * vision.spatial_merge_size, core.options.video_window_s,
                                 core.options.video_still_threshold)

    def apply(self, options: SessionOptions) -> None:
        """New session options; a new system prompt (instructions, tools, language) replaces the old one in the
        cache from the next turn on."""
        self.undo_prepared()
        changed = (options.instructions, options.tools.tools, options.language) != \
            (self.options.instructions, self.options.tools.tools, self.options.language)
        self.options = options
        if changed and self.segments:
            self.segments[0] = Segment("system", self._system_ids())
            if self.turn is None:
                self._rebuild()

    # ----- caller turn -------------------------------------------------------------------------------------
    def add_audio(self, samples: np.ndarray, at: float | None = None) -> Prefilling[None]:
        """Caller audio; `at` is the media-clock time of its first sample (None: right after the last push)."""
        self.undo_prepared()
        at = self.audio_clock if at is None else at
        if self.turn is None and not len(self.pending):
            self._turn_start_at = at
        self.pending = np.concatenate((self.pending, samples))
        self.audio_clock = at + len(samples) / INPUT_SAMPLE_RATE
        chunk = int(self.core.options.prefill_chunk_s * INPUT_SAMPLE_RATE)
        while chunk and len(self.pending) >= chunk:
            piece, self.pending = self.pending[:chunk], self.pending[chunk:]
            opening = self._open_turn()
            yield from self._prefill_turn([*opening, (yield from self._audio_piece(piece))])

    def flush(self) -> Prefilling[None]:
        """Prefill the caller audio still pending now, a chunk shorter than `prefill_chunk_s` (the caller paused:
        the turn may end, and then only the audio after this point is left to encode). Nothing with
        `prefill_chunk_s` 0, which means prefilling the whole turn at its end."""
        self.undo_prepared()
        if self.core.options.prefill_chunk_s and len(self.pending) >= audio_input.MEL_HOP:
            piece, self.pending = self.pending, np.zeros(0, dtype=np.float32)
            opening = self._open_turn()
            yield from self._prefill_turn([*opening, (yield from self._audio_piece(piece))])

    def add_image(self, image: np.ndarray, at: float) -> None:
        """A caller video frame captured at media-clock time `at`; it waits for the turn of its moment."""
        if self.core.options.video_window_s:
            self.video.add(image, at)

    def add_text(self, text: str) -> None:
        """Text the caller typed: it joins the caller's turn, after the turn's audio (a turn may be text only)."""
        self.undo_prepared()
        ids = self.core.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError("the text is empty")
        self.typed += ids

    def add_tool_output(self, output: str) -> None:
        """A function's result: it joins the caller's turn as Qwen3's template writes a tool's response
        (`<tool_response>`, a newline, the output, a newline, `</tool_response>`; newline-separated when several)."""
        self.undo_prepared()
        text = f"<tool_response>\n{output}\n</tool_response>"
        self.typed += self.core.tokenizer.encode(("\n" if self.typed else "") + text, add_special_tokens=False)

    def limit_video(self, window_s: int) -> int | None:
        """Keep at most `window_s` seconds of video in the context from the next second of video or turn on (the
        memory guard shortens the window of calls with video); returns the window, None for a call without video."""
        if not self.video.received:
            return None
        self.video.window_s = max(1, min(self.video.window_s, window_s))
        return self.video.window_s

    def recover(self) -> None:
        """After an out-of-memory error in this call's work: the caller's turn in progress (or an answer that never
        started) is dropped and the caches are prefilled again from the conversation kept so far; if even that
        does not fit, the context is emptied (`forget`)."""
        self.undo_prepared()
        release_cached(self.core.device)
        self.pending, self.typed = np.zeros(0, dtype=np.float32), []
        self.slot.answer = None
        if self.turn is not None:
            self.video.give_back(self.turn.frames)
            self.turn = None
        if self.segments and self.segments[-1].role == "user":  # its answer never started, or was never closed
            self.segments.pop()
        try:
            self._rebuild()
        except torch.OutOfMemoryError:
            release_cached(self.core.device)
            self.forget()

    def forget(self) -> None:
        """Drop the whole context (the caches are left empty and consistent): the way out when even dropping the
        caller's turn could not be prefilled again. The next turn starts with the system prompt."""
        self.undo_prepared()
        self.segments, self.turn, self.typed = [], None, []
        self.pending = np.zeros(0, dtype=np.float32)
        self._last_answer = None
        self.slot.reset(None)

    def has_audio(self) -> bool:
        return (len(self.pending) >= audio_input.MEL_HOP or (self.turn is not None and bool(self.turn.segment.audio))
                or self.prepared is not None)

    def abort_turn(self) -> None:
        self.undo_prepared()
        self.pending = np.zeros(0, dtype=np.float32)
        if self.turn is not None:
            self.video.give_back(self.turn.frames)
            self.turn = None
            self._rebuild()

    def _open_turn(self) -> list[Piece]:
        """Start the caller's turn if it has not started: its header and the video from before it."""
        if self.turn is not None:
            return []
        if not self.segments:
            self._append(Segment("system", self._system_ids()))
        start = self._turn_start_at
        per_second = self.core.model.config.thinker_config.position_id_per_seconds
        held, frames = self.video.take(start, -math.inf, 0)
        held = held[-self.video.window_s:] if self.video.window_s else []
        self._make_room(len(held))
        layout = TurnLayout(self.ids, self.video.active_since(start - 1.0), per_second)
        self.turn = Turn(Segment("user", [], np.zeros((3, 0), dtype=np.int64)), layout, start, frames=frames)
        self._place_turn()
        grids = vision_input.encode(self.core.model.thinker, [pair for _, pair in held]) if held else []
        return [layout.opening([(second, grid) for (second, _), grid in zip(held, grids)])]

    def _open_typed_turn(self, rest: list[int]) -> list[Piece]:
        """Start a caller turn that is only text: its header and `rest`, at consecutive positions (video waits
        for the next spoken turn)."""
        if not self.segments:
            self._append(Segment("system", self._system_ids()))
        self._make_room(0)
        per_second = self.core.model.config.thinker_config.position_id_per_seconds
        layout = TurnLayout(self.ids, False, per_second)
        self.turn = Turn(Segment("user", [], np.zeros((3, 0), dtype=np.int64)), layout, self.audio_clock)
        self._place_turn()
        ids = [self.ids.im_start, self.ids.user, self.ids.newline, *rest]
        return [Piece(ids, [np.arange(len(ids))[None].repeat(3, 0)])]

    def _audio_piece(self, samples: np.ndarray) -> Prefilling[Piece]:
        """Encode a stretch of the turn's audio, with the video seconds that start in it."""
        encoded = yield AudioRequest(samples)
        turn, per_second = self.turn, self.turn.layout.per_second
        seconds: list = []
        if turn.layout.video:
            first, end = turn.layout.audio_tokens, turn.layout.audio_tokens + encoded.shape[0]
            seconds, frames = self.video.take(turn.start_at, math.ceil(first / per_second), math.ceil(end / per_second))
            turn.frames += frames
        grids = vision_input.encode(self.core.model.thinker, [pair for _, pair in seconds]) if seconds else []
        self._keep_video_budget(len(grids))
        piece = turn.layout.audio(encoded.shape[0], [(second, grid) for (second, _), grid in zip(seconds, grids)])
        piece.audio.append(encoded)
        return piece

    def _prefill_turn(self, pieces: list[Piece], trailer: int = 0, talker_later: bool = False
                      ) -> Prefilling[tuple[torch.Tensor, UserPart | None]]:
        """Prefill pieces of the user turn (plus `trailer` assistant-header ids at the end); returns the hidden
        state at the last position, and with `talker_later` the Talker's user part of these pieces, left for the
        caller to prefill (with the answer's prefix, one round of the worker instead of two)."""
        piece = Piece()
        for part in pieces:
            piece.ids += part.ids
            piece.positions += part.positions
            piece.audio += part.audio
            piece.grids += part.grids
        reserve = self.core.options.max_answer_tokens + 8
        if self.cache.length + len(piece.ids) + reserve > self.cache.max_len:
            self.abort_turn()
            raise TurnTooLongError(
                f"the caller's turn does not fit in the context budget of {self.cache.max_len} tokens "
                f"(about {self.cache.max_len // 13} s of audio with room for an answer); it was dropped")
        turn = self.turn
        positions = piece.position_array()
        hidden, captured, embeds = yield from self._thinker_prefill(piece.ids, piece.audio, piece.grids,
                                                                    positions + turn.base)
        last = hidden[:, -1].clone()  # (a graph's output: the next round's prefills may overwrite it)
        user_len = len(piece.ids) - trailer
        turn.segment.extend(piece, positions, user_len)
        if self.talker is None:
            return last, None
        segment = turn.segment
        part = self._talker_user_part(piece.ids[:user_len], embeds[:, :user_len], captured[:, :user_len])
        user_part = UserPart(part, positions[:, :user_len] + turn.talker_base)
        if not talker_later:
            yield from self.talker.prefill_user_part(user_part)
        segment.talker_part = part if segment.talker_part is None else torch.cat((segment.talker_part, part), 1)
        return last, user_part if talker_later else None

    def _place_turn(self) -> None:
        """The turn starts where the context ends, in the Thinker and in the Talker."""
        self.turn.base = self.cache.next_position
        self.turn.talker_base = self.talker.next_user_position() if self.talker is not None else 0

    def _thinker_prefill(self, ids: list[int], audio: list[torch.Tensor], grids: list[vision_input.VisionGrid] = (),
                         positions: np.ndarray | None = None) -> Prefilling[tuple[torch.Tensor, ...]]:
        """The Thinker over `ids` (their audio and video features in place) at the end of the cache; returns
        (hidden, captured, embeds). A short one at sequential positions is yielded, for the worker to batch."""
        model = self.core.model
        lm = model.thinker.model.language_model
        id_tensor = to_device(torch.tensor([ids]), self.core.device)
        embeds = lm.embed_tokens(id_tensor)
        if audio:
            mask = (id_tensor == self.ids.audio).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, torch.cat(audio).to(embeds.dtype))
        deepstack = None
        if grids:
            video = id_tensor[0] == self.ids.video
            embeds = embeds.clone()
            embeds[0, video] = torch.cat([g.embeds for g in grids]).to(embeds.dtype)
            layers = len(grids[0].deepstack)
            deepstack = embeds.new_zeros(layers, *embeds.shape)  # the video tokens' features, zeros elsewhere
            deepstack[:, 0, video] = torch.stack([torch.cat([g.deepstack[i] for g in grids]) for i in range(layers)])
        positions = explicit_positions(positions, self.cache)
        if positions is None and deepstack is None and short_prefill_fits(self.cache, embeds.shape[1]):
            hidden, captured = yield PrefillRequest(self.slot, embeds)
        else:
            hidden, captured = self.core.pool.prefill_at(self.slot, embeds, positions, deepstack)
        return hidden, captured, embeds

    def run_now(self, work: Prefilling[T]) -> T:
        """Drive a generator of this class here and now, each of its prefills alone."""
        try:
            request = next(work)
            while True:
                request = work.send(self.core.run_stage([request])[0])
        except StopIteration as stop:
            return stop.value

    def _talker_user_part(self, ids: list[int], embeds: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        """The Talker's input for a piece of the user turn: the Thinker's hidden states (`captured`) projected at
        audio and video positions, its token embeddings projected at text positions. Both projections run over the
        whole piece and a mask picks (a turn's end is ≤ 32 positions: picking the positions out first cost the
        worker's thread 0.34 ms a session, 8 ms in a burst of 24 turn ends on the H200)."""
        talker = self.core.model.talker
        multimodal = np.isin(ids, self.ids.multimodal)
        if multimodal.all():
            return talker.hidden_projection(captured)
        if not multimodal.any():
            return talker.text_projection(embeds)
        mask = to_device(torch.from_numpy(multimodal)[None, :, None], embeds.device)
        return torch.where(mask, talker.hidden_projection(captured), talker.text_projection(embeds))

    def _system_ids(self) -> list[int]:
        i = self.ids
        text = system_text(self.options.instructions, self.options.tools.tools, self.options.language)
        return [i.im_start, i.system, i.newline, *self.core.tokenizer.encode(text, add_special_tokens=False),
                i.im_end, i.newline]

    def _append(self, segment: Segment) -> None:
        """Prefill a whole segment (system or assistant text) into the Thinker's cache."""
        self._prefill_segment(segment)
        self.segments.append(segment)

    def _prefill_segment(self, segment: Segment) -> None:
        """Prefill a kept segment into the Thinker's cache, where the context ends."""
        if not segment.ids:
            return
        if segment.role == "system" and not self.cache.length:  # the same in every call with this prompt
            self.core.pool.start_with(self.slot, segment.ids,
                                      lambda: self.run_now(self._thinker_prefill(segment.ids, [])))
            return
        base = self.cache.next_position
        positions = None if segment.positions is None else segment.positions + base
        self.run_now(self._thinker_prefill(segment.ids, segment.audio, segment.grids, positions))

    def _prefill_talker_part(self, segment: Segment) -> None:
        if segment.talker_part is not None:
            self.run_now(self.talker.prefill_user_part(
                UserPart(segment.talker_part, segment.positions + self.talker.next_user_position())))

    # ----- context budget ------------------------------------------------------------------------------------
    def _make_room(self, new_grids: int) -> None:
        """Before a new turn: if the cache is over half full, drop the oldest turns until it is a quarter full;
        keep the video within its budget (with `new_grids` seconds about to come)."""
        limit = self.cache.max_len
        dropped = self._drop_video(new_grids)
        if self.cache.length > limit // 2:
            while len(self.segments) > 1 and sum(len(s.ids) for s in self.segments) > limit // 4:
                del self.segments[1]  # the oldest turn after the system prompt
            dropped = True
        if dropped:
            self._rebuild()

    def _keep_video_budget(self, new_grids: int) -> None:
        """During a turn: past the video budget, drop the oldest seconds and rebuild the cache."""
        if self._drop_video(new_grids):
            self._rebuild()

    def _drop_video(self, new_grids: int) -> bool:
        """If the context would hold more than the video window plus half of it again, drop the oldest seconds of
        video down to the window. Dropping in batches keeps rebuilds rare; returns whether any was dropped."""
        window = self.video.window_s
        holders = [s for s in [*self.segments, self.turn.segment if self.turn else None] if s is not None and s.grids]
        held = sum(len(s.grids) for s in holders) + new_grids
        if held <= window + max(2, window // 2):
            return False
        for segment in holders:
            while segment.grids and held > window:
                segment.drop_oldest_grid(self.ids.video)
                held -= 1
        return True

    def _rebuild(self) -> None:
        self.cache.crop(0)
        if self.talker is not None:
            self.talker.cache.crop(0)
            self.talker.user_length = 0
        for segment in self.segments:
            self._prefill_segment(segment)
            self._prefill_talker_part(segment)
        if self.turn is not None:
            self._place_turn()
            self._prefill_segment(self.turn.segment)
            self._prefill_talker_part(self.turn.segment)

    # ----- answer ----------------------------------------------------------------------------------------------
    def prepare_answer(self) -> Prefilling[bool]:
        """The caller paused and may be done: prefill the rest of the turn and its end, and make the answer ready
        (its first token chosen, the Talker's prefix prefilled and, on a GPU, its first frame of speech made)
        without starting it. `begin_answer` then starts it at once, the audio pushed after this point being the
        turn's trailing silence, which it leaves out; any other change to the turn (audio, text, an abort) undoes
        it first. Returns whether an answer is ready (not for a turn with typed text, or whose audio is not
        prefilled in chunks).

        The first frame is made here (`EngineOptions.first_frame_in_preparation`), in the round's last stage with
        the other answers prepared in it, so that the turn's end costs no step of the GPU: with 24 callers ending
        their turns at once such a step took 45 ms, which each of them waited after their verdict
        (the engine's part of the first packet 54-64 -> 5-21 ms P50 at 24, `studies/device_ab.sh`). The Thinker
        token and Talker step that lead to its second
        frame are left to the answer's first step (`answer.speak`).

        The audio still pending goes into the answer's own prefill (one prefill, not two, at every pause), and an
        undo gives it back as pending. A turn not yet open, or with video, is flushed first: opening a turn and
        taking in video may rebuild the cache (the context budget), which a crop could not undo."""
        if self.turn is None or self.turn.layout.video:
            yield from self.flush()
        if self.turn is None or self.typed:
            return False
        turn = self.turn
        before = dataclasses.replace(turn, layout=copy.copy(turn.layout), segment=dataclasses.replace(
            turn.segment, ids=list(turn.segment.ids), audio=list(turn.segment.audio), grids=list(turn.segment.grids)))
        pending = self.pending
        cache, talker = self.cache.length, self.talker.user_length if self.talker is not None else None
        generator = self.generator.get_state()
        events: list[Event] = []
        answer = yield from self._start_answer(events.append, time.perf_counter())
        self.slot.answer = None  # not the slot's answer until it starts (a call that ends now just drops it)
        if answer.speaking and self.core.first_frame_in_preparation:
            yield FrameRequest(answer)
        self.prepared = Prepared(answer, events, before, pending, cache, talker, generator, time.perf_counter())
        return True

    def undo_prepared(self) -> None:
        """The caller went on after the pause: the prepared answer is dropped and the turn is open again, as it was."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return
        self.segments.pop()
        self.turn, self.pending = prepared.turn, prepared.pending
        self.cache.crop(prepared.cache_length)
        if prepared.talker_length is not None:
            self.talker.user_length = prepared.talker_length
            self.talker.cache.crop(prepared.talker_length)
            self.code2wav.reset()  # (its first frame was decoded; every answer's speech starts from none)
        self.generator.set_state(prepared.generator)

    def begin_answer(self, emit: Callable[[Event], None], asked_at: float) -> Prefilling[Answer]:
        """Finish the caller's turn and start the answer: the one `prepare_answer` made ready if the turn did not
        change since, or else its tail and the assistant header prefilled now, the first token chosen and, with
        speech, the Talker's assistant prefix prefilled. The frames then come from batched steps (`answer.tick`).
        `asked_at` (time.perf_counter()): when the answer was asked for, where its latency metrics start."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return (yield from self._start_answer(emit, asked_at))
        answer = prepared.answer
        now = time.perf_counter()
        answer.started = answer.step_started = asked_at  # the caller's wait starts with the turn's end
        answer.emit = emit
        for event in prepared.events:
            emit(event)
        if answer.tokens:  # its first token goes out now, made before
            answer.metrics["ttft_ms"] = (now - asked_at) * 1e3
        if answer.frames:  # and its first frame: the playout starts now
            answer.metrics["ttfp_ms"] = (now - asked_at) * 1e3
            answer.first_frame_at = now
        answer.metrics["ready_before_ms"] = (now - prepared.ready_at) * 1e3
        answer.metrics["frames_ready"] = answer.frames
        self.slot.answer = answer
        return answer

    def _start_answer(self, emit: Callable[[Event], None], started: float) -> Prefilling[Answer]:
        i = self.ids
        tail = self.pending
        self.pending = np.zeros(0, dtype=np.float32)
        typed, self.typed = self.typed, []
        header = [i.im_start, i.assistant, i.newline]
        if self.turn is None and len(tail) < audio_input.MEL_HOP:  # a typed turn: no audio block
            pieces = self._open_typed_turn([*typed, i.im_end, i.newline, *header])
        else:
            pieces = self._open_turn()
            if len(tail) >= audio_input.MEL_HOP:
                pieces.append((yield from self._audio_piece(tail)))
            pieces.append(self.turn.layout.closing(header, typed))
        last, user_part = yield from self._prefill_turn(pieces, trailer=len(header), talker_later=True)
        self.segments.append(self.turn.segment)
        self.turn = None
        answer = Answer(self, emit, started, header, self.cache.length - len(header))
        allowed = None
        tools = self.options.tools
        if tools.tools:
            answer.calls = AnswerCalls(self.core.tool_runtime, tools, self.options.max_answer_tokens,
                                       lambda event: answer.emit(event))
        if self.options.language is not None:
            answer.lock = self.core.tool_runtime.text_matcher(self.options.language,
                                                              calls=bool(tools.tools) and tools.choice == "auto")
        if (constraint := answer.constraint()) is not None:
            allowed = self.core.pool.masks.one(constraint)
        self.slot.answer = answer
        speaks = self.talker is not None and self.options.speech
        first = yield TokenRequest(last, self.options.thinker_sampling, self.generator, allowed,
                                   self.core.talker_inputs.answer_prefix(self.options.voice) if speaks else None)
        calls_first = answer.calls is not None  # (whether it speaks depends on the token: a function call's start)
        if calls_first:
            answer.add_first_token(first.token)
        if speaks and not answer.calling:
            answer.spoken = True
            side = self.core.pool.side_stream
            if side is not None:  # the Thinker's side-stream steps come after its prefill on this stream
                side.wait_stream(torch.cuda.current_stream())
            yield from self.talker.start_answer(first.talker_prefix, self.options.talker_sampling, self.generator,
                                                user_part)
            answer.speaking = True
        elif user_part is not None:  # no spoken answer: the Talker keeps the turn for the answers that speak
            yield from self.talker.prefill_user_part(user_part)
        if not calls_first:  # read once the Talker's prefill is queued (`FirstToken`)
            answer.add_first_token(first.token)
        if answer.spoken:
            answer.thinker_done = answer.thinker_done or len(answer.tokens) >= self.options.max_answer_tokens
        return answer

    def trim_last_answer(self, frames_played: int) -> None:
        """A barge-in that lands after the answer was made but before it was all heard: keep only the text of the
        first `frames_played` frames in the history (and its complete function calls), as `interrupt` does during
        the answer."""
        self.undo_prepared()
        if self._last_answer is None:
            return
        answer_start, text, calls = self._last_answer
        kept = text[:max(0, frames_played)] + calls
        header = self.segments[-1].ids[:3]
        if len(header) + len(kept) + 2 >= len(self.segments[-1].ids):
            return  # all of it was heard
        self.cache.crop(answer_start)
        self.segments[-1] = Segment("assistant", header + kept + [self.ids.im_end, self.ids.newline])
        self.run_now(self._thinker_prefill(self.segments[-1].ids, []))
        if self.turn is not None and self.turn.segment.ids:  # the caller's next turn had started: prefill it again
            self.turn.base = self.cache.next_position  # (its Talker part is not behind the answer: it stays)
            self._prefill_segment(self.turn.segment)

    def close_answer(self, answer_start: int, header: list[int], heard: list[int], calls: list[int],
                     made: list[int], spoken_text: list[int] | None) -> None:
        """Leave the caches holding the conversation with the answer as it was heard: its `heard` text, its
        complete function `calls`, then <|im_end|> and a newline. `made`: every token it drew (the cache holds the
        header and the first of them); `spoken_text`: all the text of a spoken answer, for a barge-in that comes
        after it was made (`trim_last_answer`)."""
        self._last_answer = (answer_start, spoken_text, calls) if spoken_text is not None else None
        i = self.ids
        segment = Segment("assistant", header + heard + calls + [i.im_end, i.newline])
        fed = header + made[:self.cache.length - answer_start - len(header)]  # what the cache holds of it
        keep = next((n for n, (a, b) in enumerate(zip(fed, segment.ids)) if a != b), min(len(fed), len(segment.ids)))
        self.cache.crop(answer_start + keep)
        self.run_now(self._thinker_prefill(segment.ids[keep:], []))
        self.segments.append(segment)
        if self.talker is not None:
            self.talker.end_answer()
            self.code2wav.reset()
