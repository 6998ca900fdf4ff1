"""Checks the fixed-shape audio encoder (audio_input.AudioEncoder) against the library's on the released
architecture (GPU).

    python -m studies.checks.audio_encoder [--device cuda] [--model released|tiny]

No weights are loaded: the audio encoder alone is built from the config with random weights, in bf16 on the GPU
(float32 on the CPU). For passes of several callers' audio (a pause's short piece, 1 s chunks, a 10 s stretch
across two attention windows, more chunks than the largest bucket) it prints one JSON object with, per pass, the
graphed steps against the same steps run eagerly (`graph_vs_eager`, expected bit-identical) and against the
library's encoder (`vs_library`: largest difference relative to the largest output, and the lowest cosine
similarity of a token's output). Exits 0 when every graphed pass equals its eager run and every cosine is at
least --min-cosine.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

from rtc_agent.engine.events import INPUT_SAMPLE_RATE
from rtc_agent.engine.model import tiny
from rtc_agent.engine.step import audio_input

PASSES = [[37], [99], [99] * 8, [250, 37, 163], [1000], [1000, 3, 420], [900, 900]]  # mel frames per stretch


def _speech_like(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * INPUT_SAMPLE_RATE)) / INPUT_SAMPLE_RATE
    pitch = 2 * np.pi * np.cumsum(120 + 40 * np.sin(2 * np.pi * 0.7 * t)) / INPUT_SAMPLE_RATE
    return (0.2 * sum(np.sin(k * pitch) / k for k in range(1, 6)) + 0.01 * rng.standard_normal(t.size)).astype(
        np.float32)


def check(device: torch.device, model: str, min_cosine: float) -> dict:
    config_dict = tiny.tiny_config_dict() if model == "tiny" else tiny.released_config_dict()
    audio_config = Qwen3OmniMoeConfig(**config_dict).thinker_config.audio_config
    audio_config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    tower = Qwen3OmniMoeAudioEncoder(audio_config).to(device, dtype).eval()
    extractor = WhisperFeatureExtractor(feature_size=audio_config.num_mel_bins)
    mel = audio_input.log_mel(extractor, _speech_like(20.0, seed=0))
    graphs = device.type == "cuda"
    with torch.inference_mode():
        graphed, eager = audio_input.AudioEncoder(tower, graphs), audio_input.AudioEncoder(tower, False)
        passes = []
        for frames in PASSES:
            starts = np.cumsum([0, *frames])
            features = [mel[:, a:b] for a, b in zip(starts, starts[1:])]
            library = torch.cat(audio_input.encode(tower, features)).float()
            fast, slow = torch.cat(graphed(features)).float(), torch.cat(eager(features)).float()
            cosine = torch.nn.functional.cosine_similarity(fast, library, dim=1).min().item()
            passes.append({"frames": frames, "graph_vs_eager": bool(torch.equal(fast, slow)),
                           "vs_library": {"max_diff_relative": round(((fast - library).abs().max()
                                                                      / library.abs().max()).item(), 5),
                                          "min_cosine": round(cosine, 6)}})
    passed = all(p["graph_vs_eager"] and p["vs_library"]["min_cosine"] >= min_cosine for p in passes)
    return {"model": model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "buckets": list(audio_input.CHUNK_BUCKETS), "passes": passes, "passed": passed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=["released", "tiny"], default="released")
    parser.add_argument("--min-cosine", type=float, default=0.999)
    args = parser.parse_args()
    result = check(torch.device(args.device), args.model, args.min_cosine)
    print(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
