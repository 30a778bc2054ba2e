"""The standalone queue draws a namespace of its own by default (issue 44, item 10).

Two queues built with defaults never share `queue.run_id`, so a handle of one queue's `shm` plane is refused
by the other's (`check`, `read`): the files of one are not the other's. Processes of one queue are given the
same id and read each other's handles; asyncrl keeps `default` in its config and gives each run its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from transfer_queue import TransferQueueConfig, make_storage
from transfer_queue.codec import WireError
from transfer_queue.storage.shm import ShmStorage

WRITER = """
import json, sys
import msgspec, numpy as np
from transfer_queue import TransferQueueConfig, make_storage
cfg = TransferQueueConfig(storage="shm", shm_dir=sys.argv[1], shm_arena_bytes=0, inline_max_bytes=0, **json.loads(sys.argv[2]))
plane = make_storage(cfg)
h = plane.write("u", {"x": np.arange(64, dtype=np.int64)})["x"]
print(json.dumps({"run_id": cfg.run_id, "handle": msgspec.to_builtins(h)}))
"""


def _plane(tmp_path, **kw) -> ShmStorage:
    plane = make_storage(TransferQueueConfig(storage="shm", shm_dir=str(tmp_path), shm_arena_bytes=0, inline_max_bytes=0, **kw))
    assert isinstance(plane, ShmStorage)
    return plane


def _written_elsewhere(tmp_path, **kw) -> dict:
    """A handle written by another process (a file per tensor: it outlives that process)."""
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), json.dumps(kw)], capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def test_two_queues_built_with_defaults_have_their_own_run_ids():
    ids = {TransferQueueConfig().run_id for _ in range(8)}
    assert len(ids) == 8 and all(re.fullmatch(r"tq-[0-9a-f]{12}", i) for i in ids), ids
    assert TransferQueueConfig(run_id="mine").run_id == "mine"


@pytest.mark.timeout(60)
def test_a_handle_of_one_default_queue_is_refused_by_another(tmp_path):
    a, b = _plane(tmp_path), _plane(tmp_path)
    bare = ShmStorage(shm_dir=str(tmp_path), arena_bytes=0, inline_max_bytes=0)  # the plane alone draws one too
    try:
        assert len({a.run_id, b.run_id, bare.run_id}) == 3
        h = a.write("u", {"x": np.arange(256, dtype=np.int64)})["x"]
        assert a.read([a.check(h)])[0].tolist() == list(range(256))
        for other in (b, bare):
            with pytest.raises(WireError, match="run prefix"):
                other.check(h)
            with pytest.raises(WireError, match="run prefix"):
                other.read([h])
        theirs = _written_elsewhere(tmp_path)  # another process, built with defaults: another queue
        assert theirs["run_id"] not in (a.run_id, b.run_id)
        with pytest.raises(WireError, match="run prefix"):
            a.check(theirs["handle"])
    finally:
        for p in (a, b, bare):
            p.close()


@pytest.mark.timeout(60)
def test_processes_given_the_same_run_id_read_each_others_handles(tmp_path):
    run_id = TransferQueueConfig().run_id  # what the service prints, handed to its clients
    theirs = _written_elsewhere(tmp_path, run_id=run_id)
    assert theirs["run_id"] == run_id
    mine = _plane(tmp_path, run_id=run_id)
    try:
        h = mine.check(theirs["handle"])
        assert mine.read([h])[0].tolist() == list(range(64))
        mine.free([h])
    finally:
        mine.close()


def test_asyncrl_keeps_default_in_its_config_and_gives_each_run_its_own(tmp_path):
    from asyncrl.config import Config, load
    from asyncrl.run_dir import assign_queue_run_id

    assert Config().queue.run_id == "default" and load().queue.run_id == "default"
    (tmp_path / "run-a").mkdir()
    cfg = load()
    run_id = assign_queue_run_id(cfg, tmp_path / "run-a")
    assert re.fullmatch(r"run-a-[0-9a-f]{8}", run_id) and cfg.queue.run_id == run_id
    assert (tmp_path / "run-a" / "queue_run_id").read_text().strip() == run_id
    assert assign_queue_run_id(load(), tmp_path / "run-a") == run_id  # a resume finds its own
    assert load(overrides=["queue.run_id=given"]).queue.run_id == "given"


def test_the_service_takes_and_prints_its_run_id(tmp_path, monkeypatch, capsys):
    """`python -m transfer_queue.service`: its own id unless `--run-id` names one; printed after its address."""
    import threading

    from transfer_queue import service

    made = []

    class Stop(Exception):
        pass

    class FakeService:
        def __init__(self, cfg, port=0):
            made.append(cfg)
            self.address = "tcp://127.0.0.1:1"

        def close(self):
            pass

    def wait(self, timeout=None):
        raise Stop

    monkeypatch.setattr(service, "ControllerService", FakeService)
    monkeypatch.setattr(threading.Event, "wait", wait)
    for argv in ([], ["--run-id", "shared-q"]):
        with pytest.raises(Stop):
            service.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == out[2] == "tcp://127.0.0.1:1"
    assert re.fullmatch(r"run_id=tq-[0-9a-f]{12}", out[1]) and out[3] == "run_id=shared-q"
    assert made[0].run_id == out[1].split("=", 1)[1] and made[1].run_id == "shared-q"
