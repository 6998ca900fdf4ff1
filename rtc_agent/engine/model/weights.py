"""Random weights with the right statistics: the tiny built-in model and the full-size synthetic benchmark model.

The library's own init is not usable for this: talker experts are left `torch.empty`, talker routers are zeros
(every token goes to the same experts), and a meta-device model's SnakeBeta parameters hold garbage
(uninitialised memory). One cheap fill per tensor avoids all three and is fast on the GPU.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_random(model: nn.Module, seed: int, scale: float) -> None:
    """Fill every parameter in place: norms 1, biases 0, layer scales small, matrices uniform in ±scale."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        fill_parameter(name, param, scale, generator)


@torch.no_grad()
def fill_parameter(name: str, param: torch.Tensor, scale: float, generator: torch.Generator) -> None:
    """`fill_random`'s value for one parameter; called in `named_parameters` order with one generator, it gives the
    same model."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "gamma":  # ConvNeXt layer scale
        param.fill_(1e-6)
    elif "layer_scale" in name or "scale" == leaf:
        param.fill_(0.01)
    elif leaf in ("alpha", "beta"):  # SnakeBeta, stored as logs
        param.zero_()
    elif leaf == "bias":
        param.zero_()
    elif param.ndim == 1:  # RMSNorm / LayerNorm weights
        param.fill_(1.0)
    else:
        _uniform_(param, scale, generator)


def _uniform_(param: torch.Tensor, scale: float, generator: torch.Generator) -> None:
    if param.device.type == "cpu":
        param.uniform_(-scale, scale, generator=generator)
    else:  # draw on the device: copying 66 GB of random numbers from the host would take minutes
        seed = int(torch.randint(2**62, (1,), generator=generator))
        device_generator = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-scale, scale, generator=device_generator)


def recompute_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers that `to_empty` leaves uninitialised (rotary tables, code offsets,
    the audio encoder's sinusoid table) by building each small module afresh on the CPU."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer)
        elif hasattr(module, "compute_default_singular_positional_embedding"):
            module.positional_embedding.copy_(module.compute_default_singular_positional_embedding())
        elif hasattr(module, "code_offset"):
            cfg = module.config
            offsets = torch.arange(cfg.num_quantizers).view(1, -1, 1) * cfg.codebook_size
            module.code_offset.copy_(offsets)
