"""A module kind's `forward` swapped for a fast path that can be switched back off (used by moe.py and norm.py).

A patched module keeps the library's forward as `_library_forward` and a flag `_fast_path`; its new forward
takes the fast path only where the flag is set and the input suits it, and calls the library's otherwise.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

from torch import nn


def install(model: nn.Module, is_target: Callable[[nn.Module], bool], forward: Callable, enabled: bool = True,
            supported: Callable[[nn.Module], bool] = lambda module: True) -> int:
    """Route every `is_target` module of `model` through `forward`; `enabled` False restores the library's path (a
    model never patched stays untouched; a patched one keeps the patch as a pass-through). Idempotent. Returns the
    number of modules changed."""
    count = 0
    for module in model.modules():
        if not is_target(module) or (not enabled and "_library_forward" not in module.__dict__):
            continue
        if "_library_forward" not in module.__dict__:
            module._library_forward = module.forward
            module.forward = types.MethodType(forward, module)
        module._fast_path = enabled and supported(module)
        count += 1
    return count


def patched(model: nn.Module, is_target: Callable[[nn.Module], bool]) -> list[nn.Module]:
    return [m for m in model.modules() if is_target(m) and "_fast_path" in m.__dict__]


def enabled(model: nn.Module, is_target: Callable[[nn.Module], bool]) -> bool:
    return any(m._fast_path for m in patched(model, is_target))


@contextlib.contextmanager
def library(model: nn.Module, is_target: Callable[[nn.Module], bool]) -> Iterator[None]:
    """Within the block every `is_target` module of `model` runs the library's own forward (e.g. for stock
    `generate`)."""
    modules = patched(model, is_target)
    saved = [m._fast_path for m in modules]
    for m in modules:
        m._fast_path = False
    try:
        yield
    finally:
        for m, flag in zip(modules, saved):
            m._fast_path = flag
