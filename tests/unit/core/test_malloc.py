"""asyncrl/malloc.py: glibc's mmap threshold fixed in a model's process, the environment's own setting left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import ctypes, sys
from asyncrl.malloc import fixed_mmap_threshold
print(fixed_mmap_threshold())
"""


@pytest.mark.timeout(60)
def test_the_threshold_is_fixed_unless_the_environment_sets_it():
    if "glibc" not in " ".join(__import__("platform").libc_ver()):
        pytest.skip("not glibc: mallopt's M_MMAP_THRESHOLD is glibc's")
    run = lambda env: subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=60)  # noqa: E731
    base = {k: v for k, v in __import__("os").environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert run(base).stdout.split() == ["True"]
    assert run(dict(base, MALLOC_MMAP_THRESHOLD_="65536")).stdout.split() == ["False"]
