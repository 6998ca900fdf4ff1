"""GPU memory: the process's cap, what is in use, and out-of-memory errors turned into something a call survives.

`used` is what the engine's tensors hold (`torch.cuda.memory_allocated`) plus everything on the GPU outside
PyTorch's allocator (the CUDA context, other processes). Blocks PyTorch keeps cached but free are not counted:
the allocator hands them back before it would fail an allocation. `total` is the GPU's memory times the
process's cap (`--gpu-memory-fraction`), the most PyTorch lets this process take. Under a cap this is
conservative: memory others use on the GPU is charged to this process's share.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class EngineOutOfMemory(RuntimeError):
    """The GPU ran out of memory for a piece of a call's work; that piece was dropped, the call goes on."""


@dataclass(frozen=True)
class MemoryUse:
    used_bytes: int
    total_bytes: int
    peak_bytes: int  # the most the engine's tensors held at once (torch.cuda.max_memory_allocated)

    @property
    def used_pct(self) -> float:
        return 100.0 * self.used_bytes / self.total_bytes if self.total_bytes else 0.0


def _index(device: torch.device) -> int:
    """The CUDA device's index (`cuda` alone means the current one; some torch.cuda calls need the index)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cap_process_memory(device: torch.device, fraction: float) -> None:
    """Let this process take at most `fraction` of the GPU's memory (before anything is allocated)."""
    if device.type == "cuda" and fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(fraction, _index(device))
        total = torch.cuda.get_device_properties(device).total_memory
        log.info("GPU memory capped at %.1f %% of %.1f GB = %.1f GB", fraction * 100, total / 1e9,
                 fraction * total / 1e9)


def _allocator_bytes(device: torch.device) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) bytes of PyTorch's allocator, from one read of its counters.

    Not `torch.cuda.memory_allocated` and its siblings: each of them flattens every counter of the allocator into
    a sorted dict in Python (`memory_stats`), milliseconds holding the GIL next to the engine's worker thread. The
    engine's status is read twice a second by every media process: in a burst of 24 turn ends on the H200 those
    reads were half of the engine process's event-loop time (its worker trace, `RTC_AGENT_WORKER_TRACE`)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    allocated = stats.get("allocated_bytes", {}).get("all", {})
    reserved = stats.get("reserved_bytes", {}).get("all", {})
    return allocated.get("current", 0), reserved.get("current", 0), allocated.get("peak", 0)


def read_memory(device: torch.device) -> MemoryUse | None:
    """What is in use on `device` now; None on a CPU (no GPU memory to guard). Conservative under a cap: memory
    used outside PyTorch (the CUDA context, other processes) is charged to this process's share."""
    if device.type != "cuda":
        return None
    free, device_total = torch.cuda.mem_get_info(device)
    allocated, reserved, peak = _allocator_bytes(device)
    outside = max(0, device_total - free - reserved)  # the CUDA context, other processes
    cap = int(device_total * torch.cuda.get_per_process_memory_fraction(_index(device)))
    return MemoryUse(used_bytes=allocated + outside, total_bytes=cap, peak_bytes=peak)


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) for this process on a GPU: what it may still allocate under its cap, and the cap."""
    free, device_total = torch.cuda.mem_get_info(device)
    cap = int(device_total * torch.cuda.get_per_process_memory_fraction(_index(device)))
    return min(free, cap - _allocator_bytes(device)[1]), cap


def release_cached(device: torch.device) -> None:
    """After an out-of-memory error: give the allocator's cached blocks back, so the next work starts clean."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
