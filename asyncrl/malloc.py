"""glibc's heap, kept from growing without bound in the processes that hold models: `fixed_mmap_threshold()`.

glibc serves an allocation of `M_MMAP_THRESHOLD` bytes or more by its own mmap, handed back to the system when
freed. By default that threshold starts at 128 KiB and *rises* to the size of each mmapped block freed, up to
32 MiB, so after the first tensors are freed every later one below 32 MiB comes from the heap arenas. A
process that allocates and frees many megabyte tensors of varying shapes from several threads (torch on CPU:
the rollout engine's KV cache, the trainer's activations, 3.5 MB MLP weights' gradients) then fragments its
arenas, and its resident memory grows step after step though the live tensors do not: measured with
SmolLM2-135M-Instruct in the embedded `asyncrl train` (configs/smollm2_arith.yaml), 3.3 GB more per step
(3.8 -> 17.6 GB in 4 steps, the run killed for memory at step 11), while the tensors Python could reach
stayed at 3.0 GB. A fixed threshold (`mallopt(M_MMAP_THRESHOLD, 1 MiB)`, which also turns the rising off)
keeps it flat: 2.7 -> 4.4 GB over the same 4 steps, about 10% slower per step (the big tensors' pages are
mapped and zeroed afresh).

Called at the start of `asyncrl` (the embedded run's one process) and of every Ray actor that holds a model
(trainer ranks, rollout servers). `MALLOC_MMAP_THRESHOLD_` in the environment wins (glibc's own setting);
elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number."""
THRESHOLD_BYTES = 1 << 20


def fixed_mmap_threshold(nbytes: int = THRESHOLD_BYTES) -> bool:
    """Returns whether the threshold is now fixed at `nbytes` (False: set by the environment, or no glibc)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))
