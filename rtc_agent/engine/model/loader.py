"""Turns a `--model` value into a ready Qwen3-Omni model, tokenizer and audio feature extractor.

- `tiny` (default): the built-in tiny model (see `tiny.py`), float32, fine on a CPU.
- `PATH`: a local Qwen3-Omni checkpoint directory (an HF snapshot), bf16 on the GPU.
- `synthetic:30b-a3b`: the released architecture with random weights made on the device, for benchmarks.

`quantize`: `none`, `int4` (int4.py: the experts and attention projections, quantized at load time, one module at a
time so the full-precision weights never all sit on the GPU), or `auto` (int4 where the full-precision weights and
the session slots asked for would pass `AUTO_INT4_SHARE` of the GPU's memory; logged).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..options import QUANTIZE_CHOICES
from . import tiny
from .kernels import int4
from .memory import cap_process_memory, free_bytes
from .weights import fill_parameter, fill_random, recompute_buffers

log = logging.getLogger(__name__)

SYNTHETIC_MODELS = {"synthetic:30b-a3b": tiny.released_config_dict}
SYNTHETIC_WEIGHT_SCALE = 0.03
AUTO_INT4_SHARE = 0.9


class ModelLoadError(ValueError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: Any  # Qwen3OmniMoeForConditionalGeneration
    tokenizer: Any
    feature_extractor: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    load_s: float
    quantize: str = "none"  # what was chosen: none or int4


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but this machine has no usable CUDA GPU "
                             "(torch.cuda.is_available() is False); use --device cpu or auto")
    return dev


def load(spec: str = "tiny", device: str = "auto", text_only: bool = False, dtype: str = "auto",
         quantize: str = "none", reserve_bytes: int = 0, memory_fraction: float = 1.0) -> LoadedModel:
    """`text_only`: the model is built without the Talker and Code2Wav (their weights are never allocated).
    `reserve_bytes`: what the caller will need beside the weights (session slots), for `quantize="auto"`.
    `memory_fraction`: this process may take at most that share of the GPU's memory, from before the weights on."""
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"unknown quantization {quantize!r}: use {', '.join(QUANTIZE_CHOICES)}")
    dev = resolve_device(device)
    cap_process_memory(dev, memory_fraction)
    started = time.perf_counter()
    if spec == "tiny":
        path, model_dtype = tiny.tiny_checkpoint_dir(), _dtype(dtype, torch.float32)
        quantize = _choose(quantize, _checkpoint_bytes(path), reserve_bytes, dev)
        model = _from_pretrained(path, dev, model_dtype, text_only, quantize)
    elif spec in SYNTHETIC_MODELS:
        path, model_dtype = tiny.tiny_checkpoint_dir(), _dtype(dtype, torch.bfloat16)  # tokenizer only
        model, quantize = _synthetic(SYNTHETIC_MODELS[spec](), dev, model_dtype, text_only, quantize, reserve_bytes)
    else:
        path, model_dtype = _check_checkpoint(Path(spec)), _dtype(dtype, torch.bfloat16)
        quantize = _choose(quantize, _checkpoint_bytes(path), reserve_bytes, dev)
        if quantize == "none":
            _check_fits(_checkpoint_bytes(path), dev, spec)
        model = _from_pretrained(path, dev, model_dtype, text_only, quantize)
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    tokenizer = AutoTokenizer.from_pretrained(path)
    features = WhisperFeatureExtractor.from_pretrained(path)
    model.eval().requires_grad_(False)
    load_s = time.perf_counter() - started
    log.info("model %s loaded on %s (%s, quantize %s) in %.1f s", spec, dev, model_dtype, quantize, load_s)
    if dev.type == "cuda":  # what serving needs, not the load's transient peak
        torch.cuda.reset_peak_memory_stats(dev)
    return LoadedModel(model, tokenizer, features, spec, dev, model_dtype, load_s, quantize)


def _choose(quantize: str, weight_bytes: int, reserve_bytes: int, device: torch.device) -> str:
    """`auto` -> int4 where the full-precision weights plus `reserve_bytes` would pass AUTO_INT4_SHARE of the GPU."""
    if quantize != "auto":
        return quantize
    if device.type != "cuda":
        log.info("quantize auto: none (not on a GPU)")
        return "none"
    _, total = free_bytes(device)  # the GPU's memory, or this process's cap (--gpu-memory-fraction)
    needed = weight_bytes + reserve_bytes
    choice = "int4" if needed > AUTO_INT4_SHARE * total else "none"
    log.info("quantize auto: %s (weights %.1f GB + slots %.1f GB = %.1f GB %s %.0f %% of %.1f GB)", choice,
             weight_bytes / 1e9, reserve_bytes / 1e9, needed / 1e9, ">" if choice == "int4" else "<=",
             AUTO_INT4_SHARE * 100, total / 1e9)
    return choice



def _dtype(name: str, default: torch.dtype) -> torch.dtype:
    if name == "auto":
        return default
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16") from None


def _check_checkpoint(path: Path) -> Path:
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist: give `tiny`, `synthetic:30b-a3b` or a local "
                             "Qwen3-Omni checkpoint directory (config.json, *.safetensors, tokenizer files)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: is it a Hugging Face checkpoint directory?")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from None
    if model_type != "qwen3_omni_moe":
        raise ModelLoadError(f"{path} holds a {model_type!r} model, not Qwen3-Omni (model_type 'qwen3_omni_moe')")
    return path


def _checkpoint_bytes(path: Path) -> int:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _check_fits(weight_bytes: int, device: torch.device, name: str) -> None:
    if device.type != "cuda":
        return
    free, _ = free_bytes(device)
    if weight_bytes > free * 0.95:
        raise ModelLoadError(f"model {name} needs {weight_bytes / 2**30:.1f} GiB for its weights alone, but "
                             f"{torch.cuda.get_device_name(device)} has {free / 2**30:.1f} GiB free")


def _from_pretrained(path: Path, device: torch.device, dtype: torch.dtype, text_only: bool, quantize: str):
    """The library's loader into host memory, then (int4) each quantized module moved to `device` and packed there,
    then the rest moved."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    log.info("loading %s", path)
    extra = {"enable_audio_output": False} if text_only else {}
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype, **extra)
    if quantize == "int4":
        int4.quantize_model(model, device)
    return model.to(device)


def _synthetic(config_dict: dict, device: torch.device, dtype: torch.dtype, text_only: bool, quantize: str,
               reserve_bytes: int):
    """Build the full architecture on the meta device, then allocate it on `device` and fill it cheaply; with int4,
    module by module, each quantized module packed as soon as it is filled (the same weights as unquantized).
    Returns the model and the quantization chosen (none or int4)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig(**(config_dict | {"enable_audio_output": not text_only}))
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config).to(dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("allocating %.1f B random parameters on %s", sum(p.numel() for p in model.parameters()) / 1e9, device)
    quantize = _choose(quantize, weight_bytes, reserve_bytes, device)
    if quantize == "none":
        _check_fits(weight_bytes, device, "synthetic")
        model.to_empty(device=device)
        fill_random(model, seed=0, scale=SYNTHETIC_WEIGHT_SCALE)
    else:
        _fill_quantized(model, device)
    recompute_buffers(model)
    return model, quantize


@torch.no_grad()
def _fill_quantized(model, device: torch.device) -> None:
    """`fill_random`'s weights, module by module in its order, each int4 target quantized once filled."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    targets = {id(module): (parent, name) for parent, name, module in int4.targets(model)}
    for prefix, module in list(model.named_modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, torch.nn.Parameter(torch.empty_like(param, device=device),
                                                               requires_grad=False))
            fill_parameter(f"{prefix}.{name}", getattr(module, name), SYNTHETIC_WEIGHT_SCALE, generator)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module.register_buffer(name, torch.empty_like(buffer, device=device),
                                       persistent=name not in module._non_persistent_buffers_set)
        if id(module) in targets:
            int4.quantize_module(*targets[id(module)], module)
