"""One session's model-side state: the Thinker's KV cache holding the conversation, the Talker's user context,
the streaming Code2Wav, and the turn in progress. Everything here runs on the engine's worker thread."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from . import audio_input, vision_input
from .caller_video import CallerVideo
from .code2wav import StreamingCode2Wav
from .events import INPUT_SAMPLE_RATE, Event, ResponseDone, SpeechFrame, TextDelta
from .graphs import CapturedStep, HostCopy, PaddedPrefill, replay_at
from .kv_cache import StaticKVCache
from .layout import Piece, TurnLayout
from .options import SessionOptions
from .sampling import choose, fused_active
from .stack import explicit_positions, run_stack
from .talker import TalkerState


class TurnTooLongError(ValueError):
    """The caller's turn does not fit in the context budget, even with every earlier turn dropped."""


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
class TokenIds:
    im_start: int
    im_end: int
    user: int
    assistant: int
    system: int
    newline: int
    audio: int
    audio_start: int
    audio_end: int
    vision_start: int
    vision_end: int
    video: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    multimodal: tuple[int, ...]

    @classmethod
    def from_model(cls, model, tokenizer) -> "TokenIds":
        c, t = model.config, model.config.thinker_config
        newline = tokenizer.encode("\n", add_special_tokens=False)
        if len(newline) != 1:
            raise ValueError(f"the tokenizer encodes a newline as {newline}, expected one token")
        return cls(c.im_start_token_id, c.im_end_token_id, c.user_token_id, c.assistant_token_id, c.system_token_id,
                   newline[0], t.audio_token_id, t.audio_start_token_id, t.audio_end_token_id,
                   t.vision_start_token_id, t.vision_end_token_id, t.video_token_id, c.tts_pad_token_id,
                   c.tts_bos_token_id, c.tts_eos_token_id, (t.audio_token_id, t.image_token_id, t.video_token_id))


class Conversation:
    def __init__(self, core, options: SessionOptions) -> None:
        self.core = core
        self.options = options
        self.ids: TokenIds = core.ids
        thinker_cfg = core.model.config.thinker_config.text_config
        self.cache = StaticKVCache.for_config(thinker_cfg, core.options.context_tokens, core.dtype, core.device)
        graphs = core.cuda_graphs
        talker_len = core.options.context_tokens + core.options.max_frames + 16
        fused = fused_active(core.options.fast_sampling, core.device)
        self.talker = TalkerState(core.model, talker_len, graphs, fused) if core.speech else None
        if self.talker is not None and graphs:
            self.talker.capture(options.talker_sampling, options.predictor_sampling)
        self.code2wav = StreamingCode2Wav(core.model.code2wav, core.options.max_frames + 1, graphs=graphs) if core.speech else None
        self.segments: list[Segment] = []
        self._last_answer: tuple[int, list[int]] | None = None  # (cache position, tokens) of the latest answer
        self.turn: Turn | None = None  # the user turn being prefilled
        self.pending = np.zeros(0, dtype=np.float32)  # caller audio not yet encoded
        self.typed: list[int] = []  # text ids the caller typed in this turn (they follow its audio)
        self.audio_clock = 0.0  # media-clock time just after the last audio pushed
        self._turn_start_at = 0.0  # media-clock time of the first sample of the turn being pushed
        vision = core.model.config.thinker_config.vision_config
        self.video = CallerVideo(vision.patch_size * vision.spatial_merge_size, core.options.video_window_s,
                                 core.options.video_still_threshold)
        self._thinker_step = self._thinker_prefill_graph = None
        overlap = graphs and core.options.overlap
        self._side_stream = torch.cuda.Stream(core.device) if overlap else None  # the Thinker's decode during frames
        if graphs:
            self._thinker_step = CapturedStep(self._thinker_logits, torch.zeros(1, 1, dtype=torch.long, device=core.device),
                                              stream=self._side_stream)
            self._thinker_prefill_graph = PaddedPrefill(self._thinker_stack, self.cache, thinker_cfg.hidden_size, core.dtype)
        self._token = HostCopy((1,), torch.long, core.device)  # the Thinker's next token
        if core.speech:  # each frame's codes and samples
            self._frame_codes = HostCopy((core.model.config.talker_config.num_code_groups,), torch.long, core.device)
            self._frame_samples = HostCopy((self.code2wav.samples_per_frame,), torch.float32, core.device)
        self.generator = torch.Generator(device=core.device)
        self.generator.manual_seed(options.seed if options.seed is not None else int(torch.seed() % 2**62))

    def apply(self, options: SessionOptions) -> None:
        """New session options; a new system prompt replaces the old one in the cache from the next turn on."""
        changed = options.instructions != self.options.instructions
        self.options = options
        if changed and self.segments:
            self.segments[0] = Segment("system", self._system_ids())
            if self.turn is None:
                self._rebuild()

    # ----- caller turn -------------------------------------------------------------------------------------
    def add_audio(self, samples: np.ndarray, at: float | None = None) -> None:
        """Caller audio; `at` is the media-clock time of its first sample (None: right after the last push)."""
        at = self.audio_clock if at is None else at
        if self.turn is None and not len(self.pending):
            self._turn_start_at = at
        self.pending = np.concatenate((self.pending, samples))
        self.audio_clock = at + len(samples) / INPUT_SAMPLE_RATE
        chunk = int(self.core.options.prefill_chunk_s * INPUT_SAMPLE_RATE)
        while chunk and len(self.pending) >= chunk:
            piece, self.pending = self.pending[:chunk], self.pending[chunk:]
            self._prefill_turn([*self._open_turn(), self._audio_piece(piece)])

    def add_image(self, image: np.ndarray, at: float) -> None:
        """A caller video frame captured at media-clock time `at`; it waits for the turn of its moment."""
        if self.core.options.video_window_s:
            self.video.add(image, at)

    def add_text(self, text: str) -> None:
        """Text the caller typed: it joins the caller's turn, after the turn's audio (a turn may be text only)."""
        ids = self.core.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError("the text is empty")
        self.typed += ids

    def has_audio(self) -> bool:
        return len(self.pending) >= audio_input.MEL_HOP or (self.turn is not None and bool(self.turn.segment.audio))

    def abort_turn(self) -> None:
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
        held = held[-self.core.options.video_window_s:] if self.core.options.video_window_s else []
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

    def _audio_piece(self, samples: np.ndarray) -> Piece:
        """Encode a stretch of the turn's audio, with the video seconds that start in it."""
        features = audio_input.log_mel(self.core.feature_extractor, samples)
        encoded = audio_input.encode(self.core.model.thinker, features)
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

    def _prefill_turn(self, pieces: list[Piece], trailer: int = 0) -> torch.Tensor:
        """Prefill pieces of the user turn (plus `trailer` assistant-header ids at the end); returns the logits
        at the last position."""
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
        hidden, captured, embeds = self._thinker_prefill(piece.ids, piece.audio, piece.grids, positions + turn.base)
        user_len = len(piece.ids) - trailer
        turn.segment.extend(piece, positions, user_len)
        if self.talker is not None:
            segment = turn.segment
            part = self._talker_user_part(piece.ids[:user_len], embeds[:, :user_len], captured[:, :user_len])
            self.talker.prefill_user_part(part, positions[:, :user_len] + turn.talker_base)
            segment.talker_part = part if segment.talker_part is None else torch.cat((segment.talker_part, part), 1)
        return self.core.model.thinker.lm_head(hidden[:, -1])

    def _place_turn(self) -> None:
        """The turn starts where the context ends, in the Thinker and in the Talker."""
        self.turn.base = self.cache.next_position
        self.turn.talker_base = self.talker.next_user_position() if self.talker is not None else 0

    def _thinker_prefill(self, ids: list[int], audio: list[torch.Tensor], grids: list[vision_input.VisionGrid] = (),
                         positions: np.ndarray | None = None):
        model = self.core.model
        lm = model.thinker.model.language_model
        id_tensor = torch.tensor([ids], device=self.core.device)
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
            deepstack = (video, [torch.cat([g.deepstack[i] for g in grids]) for i in range(layers)])
        positions = explicit_positions(positions, self.cache)
        if positions is None and self._thinker_prefill_graph is not None and self._thinker_prefill_graph.fits(embeds.shape[1]):
            hidden, captured = self._thinker_prefill_graph(embeds)
        else:
            hidden, captured = self._thinker_stack(embeds, graph_mode=False, positions=positions, deepstack=deepstack)
        return hidden, captured, embeds

    def _thinker_stack(self, embeds: torch.Tensor, graph_mode: bool = True, positions: torch.Tensor | None = None,
                       deepstack=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Thinker layers over `embeds`; also returns the hidden states the Talker reads (accept_hidden_layer)."""
        lm = self.core.model.thinker.model.language_model
        capture = self.core.model.config.talker_config.accept_hidden_layer if self.talker is not None else None
        hidden, captured = run_stack(lm, embeds, self.cache, mrope=True, capture_layer=capture, graph_mode=graph_mode,
                                     positions=positions, deepstack=deepstack)
        return hidden, hidden if captured is None else captured

    def _talker_user_part(self, ids: list[int], embeds: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        talker = self.core.model.talker
        mm = torch.isin(torch.tensor(ids, device=embeds.device), torch.tensor(self.ids.multimodal, device=embeds.device))
        part = torch.empty(1, len(ids), talker.config.text_config.hidden_size, device=embeds.device, dtype=embeds.dtype)
        if mm.any():
            part[0, mm] = talker.hidden_projection(captured[0, mm])
        part[0, ~mm] = talker.text_projection(embeds[0, ~mm])
        return part

    def _system_ids(self) -> list[int]:
        i = self.ids
        text = self.core.tokenizer.encode(self.options.instructions, add_special_tokens=False)
        return [i.im_start, i.system, i.newline, *text, i.im_end, i.newline]

    def _append(self, segment: Segment) -> None:
        """Prefill a whole segment (system or assistant text) into the Thinker's cache."""
        self._prefill_segment(segment)
        self.segments.append(segment)

    def _prefill_segment(self, segment: Segment) -> None:
        """Prefill a kept segment into the Thinker's cache, where the context ends."""
        if not segment.ids:
            return
        base = self.cache.next_position
        positions = None if segment.positions is None else segment.positions + base
        self._thinker_prefill(segment.ids, segment.audio, segment.grids, positions)

    def _prefill_talker_part(self, segment: Segment) -> None:
        if segment.talker_part is not None:
            self.talker.prefill_user_part(segment.talker_part, segment.positions + self.talker.next_user_position())

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
        window = self.core.options.video_window_s
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
    def answer(self) -> Iterator[Event]:
        """Finish the caller's turn and stream the answer, one step per `next()`; see `Engine` for the timing."""
        started = time.perf_counter()
        i, opts = self.ids, self.options
        tail = self.pending
        self.pending = np.zeros(0, dtype=np.float32)
        typed, self.typed = self.typed, []
        header = [i.im_start, i.assistant, i.newline]
        if self.turn is None and len(tail) < audio_input.MEL_HOP:  # a typed turn: no audio block
            pieces = self._open_typed_turn([*typed, i.im_end, i.newline, *header])
        else:
            pieces = self._open_turn()
            if len(tail) >= audio_input.MEL_HOP:
                pieces.append(self._audio_piece(tail))
            pieces.append(self.turn.layout.closing(header, typed))
        logits = self._prefill_turn(pieces, trailer=len(header))
        self.segments.append(self.turn.segment)
        self.turn = None
        answer_start = self.cache.length - len(header)

        tokens: list[int] = []  # generated text tokens, EOS excluded
        frames = 0
        frame_times: list[float] = []
        metrics: dict[str, float] = {}
        self._interrupted_at: int | None = None
        token = int(self._choose_text(logits))
        thinker_done = token == i.im_end
        if not thinker_done:
            tokens.append(token)
            metrics["ttft_ms"] = (time.perf_counter() - started) * 1e3
            yield TextDelta(self.core.tokenizer.decode([token]), token)
        try:
            if self.talker is not None:
                frames, thinker_done = yield from self._speak(tokens, token, thinker_done, header, started, metrics, frame_times)
                thinker_done = thinker_done or frames >= opts.max_frames  # cut by the length limit: text stops too
            yield from self._finish_text(tokens, thinker_done)  # text only, or the Talker ended before the text
        finally:
            interrupted = self._interrupted_at is not None
            kept = tokens if self.talker is None or not interrupted else tokens[: self._interrupted_at]
            self._close_answer(answer_start, header, kept)
            self._last_answer = (answer_start, tokens) if self.talker is not None else None
            if frame_times:
                metrics["frame_ms_p50"] = float(np.percentile(frame_times, 50) * 1e3)
                metrics["frame_ms_p90"] = float(np.percentile(frame_times, 90) * 1e3)
            metrics["audio_s"] = frames * 0.08
            self.last_done = ResponseDone(self.core.tokenizer.decode(kept), tuple(kept), frames, interrupted, metrics)
        yield self.last_done

    def _speak(self, tokens: list[int], token: int, thinker_done: bool, header: list[int], started: float,
               metrics: dict[str, float], frame_times: list[float]) -> Generator[Event, None, tuple[int, bool]]:
        """The Talker and Code2Wav loop: one frame per step, the Thinker one token ahead. Returns the frame count
        and whether the text is complete.

        On the GPU a frame does not wait for the host: the code predictor reads code 0 on the device while code 0
        travels to the host for the end-of-speech check, the Thinker's next token is decoded on a side stream next
        to the predictor and Code2Wav, and the next Talker step is queued before the frame is handed on."""
        i, opts = self.ids, self.options
        eos = self.core.model.config.talker_config.codec_eos_token_id
        frames = 0
        thinker_done = thinker_done or len(tokens) >= opts.max_answer_tokens
        role, first = self._text_input(header), self._text_input([token])
        text_after_end = 0  # talker steps fed since the text ended (tts_eos first, then tts_pad)
        speaker = self.core.speaker_id(opts.voice)
        if self._side_stream is not None:  # the Thinker's side-stream steps come after its prefill on this stream
            self._side_stream.wait_stream(torch.cuda.current_stream())
        code0 = self.talker.start_answer(role, first, self.core.tts, speaker, opts.talker_sampling, self.generator)
        step_started = started
        while self._interrupted_at is None:
            codes = self.talker.frame_codes(code0, opts.predictor_sampling, self.generator)
            if self.talker.code0_value() == eos:  # the predictor's work on it is dropped
                break
            ahead = None if thinker_done else self._text_ahead(tokens[-1])
            self._frame_codes.start(codes)
            self._frame_samples.start(self.code2wav.push(codes))
            last = frames + 1 >= opts.max_frames
            text, delta = None, None
            if ahead is not None:
                token = ahead()  # at the frame limit it goes unused: its cache position is cropped with the answer
                if not last:
                    thinker_done = token == i.im_end
                    if not thinker_done:
                        tokens.append(token)
                        delta = TextDelta(self.core.tokenizer.decode([token]), token)
                        # As in stock generate, the answer's last token (EOS, or the one at the length limit) is
                        # not spoken: tts_eos takes its place.
                        thinker_done = len(tokens) >= opts.max_answer_tokens
                        if not thinker_done:
                            text = self._text_input([token])
            if not last:
                if text is None:
                    text = self.core.tts["eos"] if text_after_end == 0 else self.core.tts["pad"]
                    text_after_end += 1
                code0 = self.talker.step(codes, text, opts.talker_sampling, self.generator)
            samples = self._frame_samples.get().numpy().copy()
            now = time.perf_counter()
            if frames == 0:
                metrics["ttfp_ms"] = (now - started) * 1e3
            else:
                frame_times.append(now - step_started)
            yield SpeechFrame(frames, samples, tuple(self._frame_codes.get().tolist()))
            step_started = time.perf_counter()
            frames += 1
            if last or self._interrupted_at is not None:
                break
            if delta is not None:
                yield delta
        return frames, thinker_done

    def _text_input(self, ids: list[int]) -> torch.Tensor:
        """The Talker's text-side input for Thinker tokens: text_projection of their embeddings [1, T, hidden]."""
        lm = self.core.model.thinker.model.language_model
        return self.core.project_text(lm.embed_tokens(torch.tensor([ids], device=self.core.device)))

    def _finish_text(self, tokens: list[int], done: bool) -> Iterator[TextDelta]:
        """Decode the rest of the text, without speech, appending to `tokens`."""
        while not done and len(tokens) < self.options.max_answer_tokens and self._interrupted_at is None:
            token = self._decode_text(tokens[-1])
            if token == self.ids.im_end:
                return
            tokens.append(token)
            yield TextDelta(self.core.tokenizer.decode([token]), token)

    def interrupt(self, frames_played: int) -> None:
        self._interrupted_at = max(0, frames_played)

    def trim_last_answer(self, frames_played: int) -> None:
        """A barge-in that lands after the answer was made but before it was all heard: keep only the text of the
        first `frames_played` frames in the history, as `interrupt` does during the answer."""
        if self._last_answer is None:
            return
        answer_start, tokens = self._last_answer
        kept = tokens[:max(0, frames_played)]
        header = self.segments[-1].ids[:3]
        if len(header) + len(kept) + 2 >= len(self.segments[-1].ids):
            return  # all of it was heard
        self.cache.crop(answer_start)
        self.segments[-1] = Segment("assistant", header + kept + [self.ids.im_end, self.ids.newline])
        self._thinker_prefill(self.segments[-1].ids, [])
        if self.turn is not None and self.turn.segment.ids:  # the caller's next turn had started: prefill it again
            self.turn.base = self.cache.next_position  # (its Talker part is not behind the answer: it stays)
            self._prefill_segment(self.turn.segment)

    def _choose_text(self, logits: torch.Tensor) -> int:
        return int(choose(logits, self.options.thinker_sampling, self.generator))

    def _thinker_logits(self, ids: torch.Tensor, graph_mode: bool = True) -> torch.Tensor:
        lm = self.core.model.thinker.model.language_model
        hidden, _ = run_stack(lm, lm.embed_tokens(ids), self.cache, mrope=True, graph_mode=graph_mode)
        return self.core.model.thinker.lm_head(hidden[:, -1])

    def _text_ahead(self, previous: int) -> Callable[[], int]:
        """Start decoding the token after `previous`; call the result for it. With CUDA graphs the step runs on a
        side stream, next to whatever the main stream does until then (the code predictor, Code2Wav); that stream
        was made to wait for the Thinker's prefill when the answer started."""
        if self._side_stream is None:
            token = self._decode_text(previous)
            return lambda: token
        with torch.cuda.stream(self._side_stream):
            ids = torch.tensor([[previous]], device=self.core.device)
            logits = replay_at(self._thinker_step, self.cache, 1, ids)
            self._token.start(choose(logits, self.options.thinker_sampling, self.generator).view(1))
        return lambda: int(self._token.get()[0])

    def _decode_text(self, previous: int) -> int:
        ids = torch.tensor([[previous]], device=self.core.device)
        if self._thinker_step is not None:
            logits = replay_at(self._thinker_step, self.cache, 1, ids)
        else:
            logits = self._thinker_logits(ids, graph_mode=False)
        return self._choose_text(logits)

    def _close_answer(self, answer_start: int, header: list[int], kept: list[int]) -> None:
        """Leave the caches holding the conversation with the answer as it was heard: its kept text, then
        <|im_end|> and a newline."""
        i = self.ids
        segment = Segment("assistant", header + kept + [i.im_end, i.newline])
        fed = self.cache.length - answer_start  # header + fed tokens
        keep = min(fed, len(header) + len(kept))
        self.cache.crop(answer_start + keep)
        self._thinker_prefill(segment.ids[keep:], [])
        self.segments.append(segment)
        if self.talker is not None:
            self.talker.end_answer()
            self.code2wav.reset()
