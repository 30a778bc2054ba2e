"""A process's resident memory for the memory benches (`bench trainer`, `bench trainer --shape`, `--speed`): now,
its peak since the last reset, and a reset that first frees what earlier cases left; on CUDA the same two
through torch's allocator (`mark`, `peak_mib`)."""

from __future__ import annotations

import ctypes
import gc


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def settle() -> float:
    """Free what earlier cases left (gc, glibc malloc_trim), reset the peak RSS; returns the RSS now (MiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return rss_mib()


def peak_rss_mib() -> float:
    """VmHWM from /proc: psutil has no peak RSS on Linux (its `memory_info` has no peak field)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def mark(cuda: bool) -> float:
    """Reset the peak and return what is held now (MiB): the RSS after `settle`, or on CUDA the memory torch has
    allocated (its cache emptied first)."""
    if not cuda:
        return settle()
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**20


def peak_mib(cuda: bool) -> float:
    """The peak since `mark` (MiB): VmHWM, or on CUDA torch's `max_memory_allocated`."""
    if not cuda:
        return peak_rss_mib()
    import torch

    return torch.cuda.max_memory_allocated() / 2**20
