"""Caller video into the Thinker: frame validation, patch-aligned sizes, patchify, and the vision encoder.

The vision encoder reads a video as temporal patches of 2 frames (`temporal_patch_size`), cut into 16x16 pixel
patches whose 2x2 neighbourhoods are merged into one Thinker token. One second of 2 fps video is therefore one
grid of (H/32)*(W/32) tokens. Attention inside the encoder never crosses a temporal patch, so encoding each second
on its own gives the same features as encoding a whole clip.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Pixel normalisation of the release's video preprocessor (Qwen3-Omni uses 0.5 / 0.5 on 0..1 pixels).
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
MAX_FRAME_SIDE = 4096


@dataclass
class VisionGrid:
    """One encoded second of video: `tokens` Thinker embeddings and the deepstack features for the same tokens."""

    height: int  # in merged tokens (pixels / 32)
    width: int
    embeds: torch.Tensor  # [height*width, thinker hidden]
    deepstack: list[torch.Tensor]  # one [height*width, thinker hidden] per deepstack layer

    @property
    def tokens(self) -> int:
        return self.height * self.width


def check_image(image: np.ndarray) -> np.ndarray:
    """Return `image` as a contiguous uint8 RGB array [H, W, 3], or raise ValueError saying what is wrong."""
    if not isinstance(image, np.ndarray):
        raise ValueError(f"a video frame must be a numpy array, got {type(image).__name__}")
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"a video frame must be RGB [height, width, 3], got shape {image.shape}")
    if image.dtype != np.uint8:
        raise ValueError(f"a video frame must be uint8 RGB, got dtype {image.dtype}")
    if min(image.shape[:2]) < 1 or max(image.shape[:2]) > MAX_FRAME_SIDE:
        raise ValueError(f"a video frame must be 1..{MAX_FRAME_SIDE} pixels a side, "
                         f"got {image.shape[1]}x{image.shape[0]}")
    return np.ascontiguousarray(image)


def patch_aligned(image: np.ndarray, unit: int) -> np.ndarray:
    """`image` resized so that both sides are multiples of `unit` (the nearest, at least one unit); unchanged if
    they already are."""
    height, width = image.shape[:2]
    target = (max(unit, round(height / unit) * unit), max(unit, round(width / unit) * unit))
    if target == (height, width):
        return image
    pixels = torch.from_numpy(image).permute(2, 0, 1)[None].float()
    resized = F.interpolate(pixels, size=target, mode="bilinear", antialias=True, align_corners=False)
    return resized[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def patchify(frames: np.ndarray, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """Pixel patches [tokens*merge*merge, 3*temporal*patch*patch] of `temporal` frames [temporal, H, W, 3] (uint8),
    normalised, in the encoder's order: merge blocks row by row, and inside a patch channel, time, row, column."""
    count, height, width, _ = frames.shape
    if count != temporal:
        raise ValueError(f"a temporal patch needs {temporal} frames, got {count}")
    pixels = (torch.from_numpy(frames).float() / 255 - PIXEL_MEAN) / PIXEL_STD  # [T, H, W, C]
    gh, gw = height // patch, width // patch
    blocks = pixels.view(temporal, gh // merge, merge, patch, gw // merge, merge, patch, 3)
    # -> [gh/m, gw/m, m, m, C, T, p, p]
    blocks = blocks.permute(1, 4, 2, 5, 7, 0, 3, 6)
    return blocks.reshape(gh * gw, 3 * temporal * patch * patch)


def encode(thinker, grids: list[np.ndarray]) -> list[VisionGrid]:
    """Encode seconds of video, each `temporal` frames [T, H, W, 3] of one size, in one vision-encoder call."""
    visual = thinker.model.visual
    cfg = visual.config
    unit = cfg.patch_size * cfg.spatial_merge_size
    pixels, shapes = [], []
    for frames in grids:
        pixels.append(patchify(frames, cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size))
        shapes.append((1, frames.shape[1] // cfg.patch_size, frames.shape[2] // cfg.patch_size))
        if frames.shape[1] % unit or frames.shape[2] % unit:
            raise ValueError(f"frames must be multiples of {unit} pixels a side, "
                             f"got {frames.shape[2]}x{frames.shape[1]}")
    device = next(visual.parameters()).device
    grid_thw = torch.tensor(shapes, device=device)
    out = visual(torch.cat(pixels).to(device=device, dtype=visual.dtype), grid_thw=grid_thw)
    sizes = [h * w // cfg.spatial_merge_size**2 for _, h, w in shapes]
    embeds = torch.split(out.pooler_output, sizes)
    deepstack = [torch.split(feature, sizes) for feature in out.deepstack_features]
    merge = cfg.spatial_merge_size
    return [VisionGrid(h // merge, w // merge, embeds[i], [layer[i] for layer in deepstack])
            for i, (_, h, w) in enumerate(shapes)]
