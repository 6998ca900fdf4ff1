"""The Talker side of every session slot: the Talker's and code predictor's KV caches (one row a slot), the user
parts each slot keeps across turns, and one frame per step for a batch of slots (code 0 from the Talker, codes
1-15 from the code predictor)."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch

from ..model.kernels import moe
from ..model.kv_cache import StaticKVCache
from ..model.stack import FixedStep, explicit_positions, run_stack
from ..scheduler.policy import TalkerPrefillRequest
from .graphs import (
    VIDEO_PREFILL_POSITIONS,
    BatchedPrefill,
    CapturedStep,
    DeviceCopy,
    HostCopy,
    PaddedPrefill,
    begin_rows,
    commit_rows,
    rows_for,
    short_prefill_fits,
    to_device,
)
from .sampling import Sampling, choose, draw_groups, gumbel_rows


@dataclass(frozen=True)
class CodeDraw:
    """How an answer's first code 0 is drawn: its Talker sampling settings and its session's generator."""

    sampling: Sampling
    generator: torch.Generator


TalkerPrefilling = Generator[TalkerPrefillRequest, tuple[torch.Tensor, torch.Tensor], None]


@dataclass
class UserPart:
    """A piece of a user turn for the Talker's context: input embeddings [1, T, hidden] at rotary positions [3, T]."""

    embeds: torch.Tensor
    positions: np.ndarray


class Talker:
    """Batched state and steps. Row b of every buffer belongs to slot b; a batched step runs over the first
    `rows` slots, and rows that take no part (`active` False) write to their cache's scratch position and keep
    their state.

    On the GPU a frame never waits on the host: code 0 is chosen on the device (its repetition penalty reads a
    device mask of the codes chosen so far), the code predictor reads it from there, and the frame's codes feed
    Code2Wav and the next Talker step as a device tensor. Code 0 travels to the host beside that work
    (`code0_values`), for the end-of-speech check."""

    def __init__(self, model, slots: int, max_len: int, graphs: bool = False, fused_sampling: bool = False,
                 video: bool = False) -> None:
        """`video`: calls may have video, whose user parts come at TMRoPE positions (graphed on the GPU too)."""
        self.talker = model.talker
        self.config = model.config.talker_config
        param = next(self.talker.parameters())
        self.device = param.device
        self.cache = StaticKVCache.for_config(self.config.text_config, max_len, param.dtype, param.device, batch=slots)
        predictor = self.talker.code_predictor
        self.predictor_cache = StaticKVCache.for_config(predictor.config, self.config.num_code_groups + 1,
                                                        param.dtype, param.device, batch=slots)
        self.vocab = self.config.text_config.vocab_size
        self.residual_vocab = self.config.code_predictor_config.vocab_size
        self.suppress = torch.zeros(1, self.vocab, dtype=torch.bool, device=param.device)  # never chosen as code 0
        self.suppress[0, self.vocab - 1024:] = True
        self.suppress[0, self.config.codec_eos_token_id] = False
        self.seen = torch.zeros(slots, self.vocab, dtype=torch.bool, device=param.device)  # repetition history
        self._true = torch.ones((), dtype=torch.bool, device=param.device)  # (made on the spot it would sync)
        hidden = self.config.text_config.hidden_size
        self.last_hidden = param.new_zeros(slots, 1, hidden)  # each row's Talker output at its last position
        self.code0 = torch.zeros(slots, 1, dtype=torch.long, device=param.device)  # each row's latest code 0
        self._code0_host = HostCopy((slots, 1), torch.long, param.device)
        self._step_inputs = DeviceCopy((3, slots), torch.long, param.device)  # a step's positions, deltas, active
        self.graphs = graphs
        self.video = video
        self.prefill_pool = torch.cuda.graph_pool_handle() if graphs else None  # video and batched prefills
        self.fused_sampling = fused_sampling  # draws with sampling.sample_triton (CUDA)
        self._views: dict[int, tuple[StaticKVCache, StaticKVCache]] = {}  # rows -> (talker, predictor) caches
        self._steps: dict[tuple[int, Sampling], CapturedStep] = {}
        self._predictors: dict[tuple[int, Sampling], CapturedStep] = {}
        self._batched_prefill = BatchedPrefill(
            self.cache, lambda e, view: self._talker_logits(view, e, graph_mode=True), hidden, param.dtype, graphs,
            self.prefill_pool)
        self.rows = [TalkerRow(self, index) for index in range(slots)]

    def capture(self, rows: int, talker_sampling: Sampling, predictor_sampling: Sampling) -> None:
        """The steps of a batch of `rows` slots under these sampling settings (CUDA graphs on the GPU)."""
        self._step_for(rows, talker_sampling)
        self._predictor_for(rows, predictor_sampling)
        if rows > 1:
            self._batched_prefill.capture_all(rows)

    def prefill(self, requests: list[TalkerPrefillRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run short Talker prefills of distinct slots; returns each one's (hidden, logits) [1, T, ...]. One runs
        alone (its row's graph, or eagerly on the CPU); several as one batched step over the first rows. The
        answers' first codes 0 are then drawn together."""
        if len(requests) == 1:
            results = [requests[0].row.run(requests[0].embeds)]
        else:
            rows = rows_for(max(r.row.index for r in requests), len(self.rows))
            results = self._batched_prefill(rows, [(r.row.index, r.row.cache, r.embeds) for r in requests])
        drawn = [(r, result) for r, result in zip(requests, results) if r.draw is not None]
        if drawn:
            self.first_codes([r.row.index for r, _ in drawn], [r.draw for r, _ in drawn],
                             torch.cat([logits[:, -1] for _, (_, logits) in drawn]),
                             torch.cat([hidden[:, -1:] for _, (hidden, _) in drawn]))
        return results

    def first_codes(self, rows: list[int], draws: list[CodeDraw], logits: torch.Tensor, hidden: torch.Tensor
                    ) -> None:
        """Start the answers of `rows`: each one's repetition history empty, its last hidden state `hidden[i]`
        [n, 1, hidden], and its first code 0 drawn from `logits[i]` [n, vocab] under `draws[i]`, on the device
        (`code0`), as `choose_code0` draws it for that row alone (rows drawn together as `draw_groups` says)."""
        index = to_device(torch.tensor(rows), self.device)
        self.seen.index_fill_(0, index, False)
        self.last_hidden.index_copy_(0, index, hidden)
        noise = gumbel_rows([None if d.sampling.greedy else d.generator for d in draws], self.vocab, self.device)
        groups = draw_groups([d.sampling for d in draws], [not d.sampling.greedy for d in draws])
        for sampling, members in groups.items():
            chosen = index if len(members) == len(rows) else to_device(torch.tensor([rows[i] for i in members]),
                                                                        self.device)
            picked = to_device(torch.tensor(members), self.device)
            code0 = self.choose_code0(logits.index_select(0, picked), sampling, noise.index_select(0, picked),
                                      self.seen.index_select(0, chosen))
            self.seen.index_put_((chosen, code0.view(-1)), self._true)
            self.code0.index_copy_(0, chosen, code0)
        self.start_code0_copy()

    def _view(self, rows: int) -> tuple[StaticKVCache, StaticKVCache]:
        if rows not in self._views:
            self._views[rows] = (self.cache.batch_view(rows), self.predictor_cache.batch_view(rows))
        return self._views[rows]

    def _step_for(self, rows: int, sampling: Sampling) -> CapturedStep:
        key = (rows, sampling)
        if key not in self._steps:
            groups, hidden = self.config.num_code_groups, self.config.text_config.hidden_size
            cache, _ = self._view(rows)
            cache.position.fill_(cache.scratch)  # the capture's writes land in the scratch position
            saved = (self.seen.clone(), self.last_hidden.clone(), self.code0.clone())
            self._steps[key] = CapturedStep(
                lambda c, t, n, a: self._frame_step(cache, c, t, n, a, sampling),
                torch.zeros(rows, groups, dtype=torch.long, device=self.device),
                self.last_hidden.new_zeros(rows, 1, hidden), torch.zeros(rows, self.vocab, device=self.device),
                torch.zeros(rows, dtype=torch.bool, device=self.device),
                graph=self.graphs)
            for buffer, value in zip((self.seen, self.last_hidden, self.code0), saved):
                buffer.copy_(value)
        return self._steps[key]

    def _predictor_for(self, rows: int, sampling: Sampling) -> CapturedStep:
        key = (rows, sampling)
        if key not in self._predictors:
            _, cache = self._view(rows)
            noise = torch.zeros(rows, (self.config.num_code_groups - 1) * self.residual_vocab, device=self.device)
            steps = self._predictor_steps(rows)
            self._predictors[key] = CapturedStep(lambda n: self._predict(cache, steps, n, sampling), noise,
                                                 graph=self.graphs)
        return self._predictors[key]

    def _talker_logits(self, cache: StaticKVCache, embeds: torch.Tensor, graph_mode: bool = False,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, _ = run_stack(self.talker.model, embeds, cache, mrope=True, graph_mode=graph_mode, positions=positions)
        return hidden, self.talker.codec_head(hidden)

    def choose_code0(self, logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor, seen: torch.Tensor,
                     active: torch.Tensor | None = None) -> torch.Tensor:
        """Code 0 [rows, 1] from the Talker's logits at one position per row, on the device; it joins the
        repetition history `seen` of the rows that are `active` (all where None)."""
        code0 = choose(logits, sampling, seen=seen, suppress=self.suppress, noise=noise,
                       fused=self.fused_sampling).view(-1, 1)
        mark = seen.gather(1, code0) | (True if active is None else active[:, None])
        seen.scatter_(1, code0, mark)
        return code0

    def _frame_step(self, cache: StaticKVCache, codes: torch.Tensor, text: torch.Tensor, noise: torch.Tensor,
                    active: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """Each row's last frame codes [rows, 16] plus one text position [rows, 1, hidden] in; each active row's
        last hidden state and code 0 updated in place."""
        rows = codes.shape[0]
        with moe.skipping_rows(active):  # (the rows sitting the step out read no expert weights)
            hidden, logits = self._talker_logits(cache, self.codec_embedding_sum(codes) + text, graph_mode=True)
        code0 = self.choose_code0(logits[:, -1], sampling, noise, self.seen[:rows], active)
        self.last_hidden[:rows].copy_(torch.where(active[:, None, None], hidden[:, -1:], self.last_hidden[:rows]))
        self.code0[:rows].copy_(torch.where(active[:, None], code0, self.code0[:rows]))
        return self.code0[:rows]

    def _predictor_steps(self, rows: int) -> list[FixedStep]:
        """The code predictor's 15 steps for a batch of `rows`: step 0 at positions 0-1 (two inputs), step g at
        position g + 1; the same in every frame."""
        predictor, (_, cache) = self.talker.code_predictor, self._view(rows)
        return [FixedStep.at(predictor.model, cache, 0 if group == 0 else group + 1, 2 if group == 0 else 1,
                             self.last_hidden.dtype) for group in range(self.config.num_code_groups - 1)]

    def _predict(self, cache: StaticKVCache, steps: list[FixedStep], noise: torch.Tensor, sampling: Sampling
                 ) -> torch.Tensor:
        """Codes 1..15 [rows, 15] from each row's last hidden state and code 0: step 0 reads [hidden, embed(code
        0)], step g reads codec_embedding[g-1](code g); each step has its own lm_head."""
        predictor, rows = self.talker.code_predictor, noise.shape[0]
        noise = noise.view(rows, self.config.num_code_groups - 1, -1)
        code, codes = self.code0[:rows], []
        for group, step in enumerate(steps):
            if group == 0:
                embeds = torch.cat((self.last_hidden[:rows], self.talker.get_input_embeddings()(code)), dim=1)
            else:
                embeds = predictor.model.codec_embedding[group - 1](code)
            hidden, _ = run_stack(predictor.model, embeds, cache, mrope=False, graph_mode=True, fixed=step)
            code = choose(predictor.lm_head[group](hidden[:, -1]), sampling, noise=noise[:, group],
                          fused=self.fused_sampling).view(rows, 1)
            codes.append(code)
        return torch.cat(codes, dim=1)

    def frame_codes(self, rows: int, sampling: Sampling, noise: torch.Tensor) -> torch.Tensor:
        """All 16 codes [rows, 16] (on the device) of the frames whose code 0 each of the first `rows` rows holds.
        `noise` [rows, 15 * vocab]: Gumbel noise of the draws (zeros for greedy rows)."""
        residual = self._predictor_for(rows, sampling)(noise)
        return torch.cat((self.code0[:rows], residual), dim=1)

    def step(self, rows: list[int | None], codes: torch.Tensor, text: torch.Tensor, sampling: Sampling,
             noise: torch.Tensor) -> None:
        """One Talker step for a batch: `rows[i]` is the `TalkerRow` index stepping in row i (None: row i sits
        this step out). Each stepping row's code 0 and last hidden state are updated on the device."""
        count = len(rows)
        cache, _ = self._view(count)
        step = self._step_for(count, sampling)  # (a capture sets the positions: before they are filled in)
        caches = [self.rows[index].cache if index is not None else None for index in rows]
        step(codes, text, noise, begin_rows(cache, caches, self._step_inputs))
        commit_rows(caches)
        self.start_code0_copy()

    def start_code0_copy(self) -> None:
        self._code0_host.start(self.code0)

    def code0_values(self) -> torch.Tensor:
        """Every row's latest code 0 on the host [slots]; waits for the latest step only, not for work queued
        after it."""
        return self._code0_host.get().view(-1)

    def codec_embedding_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of each row's frame (codes [rows, 16]) [rows, 1, hidden], the
        Talker's input for the next step."""
        ids = codes[:, :, None]  # [rows, 16, 1]
        parts = [self.talker.get_input_embeddings()(ids[:, 0])]
        parts += [emb(ids[:, g + 1]) for g, emb in enumerate(self.talker.code_predictor.model.codec_embedding)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True)


class TalkerRow:
    """One slot's Talker context: its cache row, the user parts it keeps across turns, its answer's prefix."""

    def __init__(self, talker: Talker, index: int) -> None:
        self.talker, self.index = talker, index
        self.cache = talker.cache.row(index)
        self.user_length = 0  # positions of the cache that hold user parts (kept across turns)
        self._graph: PaddedPrefill | None = None  # short prefills at sequential positions (GPU)
        self._video_graph: PaddedPrefill | None = None  # user parts at TMRoPE positions (turns with video)
        if talker.graphs:
            self._graph = PaddedPrefill(lambda e: talker._talker_logits(self.cache, e, graph_mode=True), self.cache,
                                        talker.config.text_config.hidden_size, talker.last_hidden.dtype)
            if talker.video:
                self._video_graph = self.video_prefill()

    def video_prefill(self, size: int = VIDEO_PREFILL_POSITIONS, graph: bool = True) -> PaddedPrefill:
        """This row's graphed prefill at TMRoPE positions (`graph` False: the same code run eagerly, as the CPU
        tests do)."""
        talker = self.talker
        return PaddedPrefill(lambda e, p: talker._talker_logits(self.cache, e, graph_mode=True, positions=p),
                             self.cache, talker.config.text_config.hidden_size, talker.last_hidden.dtype, size,
                             positioned=True, graph=graph, pool=talker.prefill_pool)

    def run(self, embeds: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Talker layers over `embeds` at the end of the cache (at TMRoPE `positions` if given), through a graph
        where one fits."""
        graph = self._graph if positions is None else self._video_graph
        if graph is not None and graph.fits(embeds.shape[1]):
            return graph(embeds, positions)
        return self.talker._talker_logits(self.cache, embeds, positions=positions)

    def reset(self) -> None:
        """Forget everything (the slot's call ended)."""
        self.cache.crop(0)
        self.user_length = 0

    def next_user_position(self) -> int:
        """Rotary position where the next user part goes (the assistant part of an answer is dropped first)."""
        self.cache.crop(self.user_length)
        return self.cache.next_position

    def _prefill(self, embeds: torch.Tensor, positions: torch.Tensor | None = None, draw: CodeDraw | None = None
                 ) -> Generator[TalkerPrefillRequest, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
        """Talker layers over `embeds` at the end of the cache; a short one at sequential positions is yielded,
        for the worker to batch with other slots'. Returns (hidden, logits). `draw`: an answer's prefix, whose
        first code 0 is drawn after it (`Talker.first_codes`)."""
        if positions is None and short_prefill_fits(self.cache, embeds.shape[1]):
            return (yield TalkerPrefillRequest(self, embeds, draw))
        hidden, logits = self.run(embeds, positions)
        if draw is not None:
            self.talker.first_codes([self.index], [draw], logits[:, -1], hidden[:, -1:])
        return hidden, logits

    def prefill_user_part(self, part: UserPart) -> TalkerPrefilling:
        """Append a piece of a user turn to the kept user context."""
        self.cache.crop(self.user_length)
        yield from self._prefill(part.embeds, explicit_positions(part.positions, self.cache))
        self.user_length = self.cache.length

    def _joins(self, user_part: UserPart, prefix: int) -> bool:
        """Whether `user_part` and a `prefix` of that many positions make one short prefill at the cache's end."""
        return (explicit_positions(user_part.positions, self.cache) is None
                and short_prefill_fits(self.cache, user_part.embeds.shape[1] + prefix))

    def end_answer(self) -> None:
        self.cache.crop(self.user_length)

    def start_answer(self, prefix: torch.Tensor, sampling: Sampling, generator, user_part: UserPart | None = None
                     ) -> TalkerPrefilling:
        """Prefill the 9-position assistant `prefix` (`FirstToken.talker_prefix`) and choose code 0 of the first
        frame (on the device, in `Talker.code0` of this row).

        `user_part`: the end of the caller's turn, not yet in the user context. Where it sits at the sequential
        positions and fits one short prefill with the prefix, the two are one prefill: a turn end then costs the
        worker one round of Talker prefills instead of two (in a burst of turn ends, each round adds a wait for the
        GPU and a pass over every session in it).
        """
        self.cache.crop(self.user_length)
        joined = user_part is not None and self._joins(user_part, prefix.shape[1])
        if joined:
            prefix = torch.cat((user_part.embeds, prefix), dim=1)
        elif user_part is not None:
            yield from self.prefill_user_part(user_part)
        yield from self._prefill(prefix, draw=CodeDraw(sampling, generator))
        if joined:
            self.user_length += user_part.embeds.shape[1]
