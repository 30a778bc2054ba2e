"""Fixtures of the transfer_queue integration tests: a controller service in its own process."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.integration.transfer_queue import _procs

CTX = mp.get_context("spawn")


@pytest.fixture
def service(tmp_path):
    """Start a controller service process; yields a function cfg -> client config."""
    procs = []

    def start(**kw):
        kw.setdefault("shm_dir", str(tmp_path))
        kw.setdefault("run_id", "it")
        out = CTX.Queue()
        p = CTX.Process(target=_procs.serve, args=(kw, out), daemon=True)
        p.start()
        procs.append(p)
        address, storage_address = out.get(timeout=60)
        return dict(kw, controller_address=address)

    yield start
    for p in procs:
        p.kill()
        p.join()
