"""Token ids and TMRoPE positions of one caller turn, built piece by piece while the caller talks.

The layout is the one the library's processor and `get_rope_index` give a conversation turn:

    <|im_start|>user\\n [<|vision_start|> video seconds <|vision_end|>]            (video before the caller spoke)
    [<|vision_start|>]<|audio_start|> audio tokens, each video second before the audio token of its start time
    <|audio_end|>[<|vision_end|>]<|im_end|>\\n                                     (video while the caller spoke)

Audio token j sits at position `start + j` (13 tokens a second); a video second k at time position
`start + 13 k`, and at height and width positions `start + row`, `start + column`; a token after a block takes
the largest position of the block's last token plus one. Positions here are relative to the turn's first token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class GridShape(Protocol):
    height: int  # merged tokens
    width: int


@dataclass
class Piece:
    """Part of a turn, in the order it is prefilled."""

    ids: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)  # [3, n] blocks, relative to the turn's start
    grids: list = field(default_factory=list)  # the video seconds whose tokens are in `ids`, in order
    audio: list = field(default_factory=list)  # the encoded audio for its audio tokens, in order (set by the caller)

    def position_array(self) -> np.ndarray:
        return np.concatenate(self.positions, axis=1) if self.positions else np.zeros((3, 0), dtype=np.int64)


class TurnLayout:
    def __init__(self, ids, video: bool, per_second: int) -> None:
        self.ids = ids
        self.video = video  # the audio block is audio-in-video: video seconds go between its audio tokens
        self.per_second = per_second  # rotary positions per second of time (audio tokens per second)
        self.audio_tokens = 0  # audio tokens laid out so far
        self._block_start = 0
        self._last_max = -1  # largest position of the last token laid out

    def opening(self, held: list[tuple[int, GridShape]]) -> Piece:
        """The turn's header, the video seconds (second, grid) from before the caller spoke, and the start of the
        audio block."""
        i, piece = self.ids, Piece()
        self._text(piece, [i.im_start, i.user, i.newline])
        if held:
            self._text(piece, [i.vision_start])
            start, first = self._last_max + 1, held[0][0]
            for second, grid in held:
                self._grid(piece, grid, start, start + self.per_second * (second - first))
            self._text(piece, [i.vision_end])
        self._text(piece, [i.vision_start, i.audio_start] if self.video else [i.audio_start])
        self._block_start = self._last_max + 1
        return piece

    def audio(self, count: int, grids: list[tuple[int, GridShape]]) -> Piece:
        """`count` more audio tokens, with the video seconds (second since the turn's audio began, grid) that start
        among them, each before the audio token of its start time."""
        piece = Piece()
        end = self.audio_tokens + count
        for second, grid in grids:
            at = self.per_second * second
            if not self.video or not self.audio_tokens <= at < end:
                raise ValueError(f"video second {second} does not start among audio tokens {self.audio_tokens}..{end}")
            self._audio(piece, at - self.audio_tokens)
            self._grid(piece, grid, self._block_start, self._block_start + at)
        self._audio(piece, end - self.audio_tokens)
        return piece

    def closing(self, trailer: list[int], typed: list[int] = ()) -> Piece:
        """The end of the audio block, the caller's `typed` text ids, the end of the turn, then `trailer` (the
        assistant's header)."""
        i, piece = self.ids, Piece()
        self._text(piece, [i.audio_end, i.vision_end] if self.video else [i.audio_end])
        self._text(piece, [*typed, i.im_end, i.newline, *trailer])
        return piece

    def _text(self, piece: Piece, ids: list[int]) -> None:
        start = self._last_max + 1
        self._append(piece, ids, np.arange(start, start + len(ids)).repeat(3).reshape(-1, 3).T)

    def _audio(self, piece: Piece, count: int) -> None:
        start = self._block_start + self.audio_tokens
        self.audio_tokens += count
        if count:
            self._append(piece, [self.ids.audio] * count, np.arange(start, start + count)[None].repeat(3, 0))

    def _grid(self, piece: Piece, grid: GridShape, start: int, time: int) -> None:
        rows, cols = np.meshgrid(np.arange(grid.height), np.arange(grid.width), indexing="ij")
        positions = np.stack([np.full(rows.size, time), start + rows.ravel(), start + cols.ravel()])
        self._append(piece, [self.ids.video] * rows.size, positions)
        piece.grids.append(grid)

    def _append(self, piece: Piece, ids: list[int], positions: np.ndarray) -> None:
        piece.ids += ids
        piece.positions.append(positions.astype(np.int64))
        self._last_max = int(positions[:, -1].max())

