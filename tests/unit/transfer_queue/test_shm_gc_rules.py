"""What runs that are gone left in a shm directory: `shm.scan` judges each run by the locks its
processes hold (real `flock`s, held here by this process for a live run), `asyncrl.shm_gc` removes by
the table of its docstring. Files are made by hand under the plane's names; another uid's files are
made as root and given away."""

from __future__ import annotations

import fcntl
import json
import os
import time

import pytest

from asyncrl.shm_gc import collect
from transfer_queue.storage.shm import ShmStorage
from transfer_queue.storage.shm_runs import scan

NOW = time.time()


def _file(d, name, data=b"x" * 4096, age_s=0.0):
    p = d / name
    p.write_bytes(data)
    os.utime(p, (NOW - age_s, NOW - age_s))
    return p


def _run(d, run_id, note=None, age_s=0.0, segment=False):
    """A run that is gone: an arena (or a file per tensor of a pid that is not alive) and its mark."""
    name = f"tq-{run_id}-999999-abcdef-7" if segment else f"tq-{run_id}-4242-abcdef-arena"
    paths = [_file(d, name, age_s=age_s)]
    if note is not None:
        paths.append(_file(d, f"tq-{run_id}.run", json.dumps(note).encode(), age_s=age_s))
    return paths


def _run_dir(tmp_path, name, checkpoint=True, state="running"):
    d = tmp_path / "runs" / name
    (d / "checkpoints" / "step_000002").mkdir(parents=True)
    if checkpoint:
        (d / "checkpoints" / "step_000002" / "state.json").write_text("{}")
    (d / "status.json").write_text(json.dumps({"state": state}))
    return str(d)


def test_each_kind_of_run_that_is_gone_is_removed_or_kept_by_the_table(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    memory = _run(shm, "mem-1", {"durable": False})
    resumable = _run(shm, "dur-ckpt", {"durable": True, "run_dir": _run_dir(tmp_path, "a")}, segment=True)
    old = _run(shm, "dur-old", {"durable": True, "run_dir": _run_dir(tmp_path, "b")}, age_s=7200)
    no_ckpt = _run(shm, "dur-none", {"durable": True, "run_dir": _run_dir(tmp_path, "c", checkpoint=False)})
    finished = _run(shm, "dur-done", {"durable": True, "run_dir": _run_dir(tmp_path, "d", state="finished")})
    unknown = _run(shm, "older-version")
    unknown_old = _run(shm, "older-version-2", age_s=7200)
    remote = _run(shm, "dur-remote", {"durable": True})  # a producer's mark on a host without the controller
    report = collect(str(shm), keep_s=3600)
    why = {v.run_id: v.why for v in report.dead}
    for paths in (memory, old, no_ckpt, finished, unknown_old):
        assert not any(p.exists() for p in paths), why
    for paths in (resumable, unknown, remote):
        assert all(p.exists() for p in paths), why
    assert "may read them" in why["dur-ckpt"] and "in memory" in why["mem-1"] and "finished" in why["dur-done"]
    assert "no checkpoint" in why["dur-none"] and "queue.shm_keep_s" in why["dur-old"]
    summary = report.summary()
    assert summary["runs"] == 8 and set(summary["kept"]) == {"dur-ckpt", "older-version", "dur-remote"}
    assert summary["removed_files"] == 2 + 2 + 2 + 2 + 1


def test_a_live_run_and_another_users_files_are_never_touched(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    live_arena = _run(shm, "live-1", {"durable": False})[0]
    marked = _run(shm, "live-2", {"durable": False})
    theirs = _run(shm, "mem-3", {"durable": False}, age_s=10 ** 6)
    for p in theirs:
        os.chown(p, 54321, 54321)  # another user's (this test runs as root, who could unlink them)
    fds = [os.open(live_arena, os.O_RDONLY), os.open(marked[1], os.O_RDONLY)]
    try:
        for fd in fds:  # what the runs' processes hold while they live
            fcntl.flock(fd, fcntl.LOCK_SH)
        runs = scan(str(shm))
        assert runs["live-1"].live and runs["live-2"].live and "mem-3" not in runs
        report = collect(str(shm), keep_s=0)
        assert report.live_runs == 2 and not report.dead
        assert live_arena.exists() and all(p.exists() for p in marked + theirs)
    finally:
        for fd in fds:
            os.close(fd)
    report = collect(str(shm), keep_s=0)  # their processes gone: now they go, the other user's stay
    assert not live_arena.exists() and not any(p.exists() for p in marked) and all(p.exists() for p in theirs)


def test_a_plane_holds_its_runs_mark_while_open_and_removes_it_when_the_last_leaves(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    a = ShmStorage(shm_dir=str(shm), run_id="r1", arena_bytes=1 << 20)
    b = ShmStorage(shm_dir=str(shm), run_id="r1", arena_bytes=1 << 20, sweep_arenas=False)
    import numpy as np

    a.write("u", {"x": np.arange(1000, dtype=np.float32)}, inline=False)  # into its arena
    mark = shm / "tq-r1.run"
    assert json.loads(mark.read_text()) == {"durable": False}  # the first plane's note; b never rewrote it
    b.note_run({"durable": True, "run_dir": "/x"})
    assert json.loads(mark.read_text()) == {"durable": True, "run_dir": "/x"}
    assert scan(str(shm))["r1"].live
    a.close()
    assert mark.exists() and scan(str(shm))["r1"].live  # b still holds it
    b.close()
    assert not mark.exists() and not list(shm.iterdir())


@pytest.mark.parametrize("planted", ["link", "theirs"])
def test_a_mark_planted_by_someone_else_is_neither_written_nor_held(tmp_path, planted):
    shm = tmp_path / "shm"
    shm.mkdir()
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    mark = shm / "tq-r2.run"
    if planted == "link":
        mark.symlink_to(target)
    else:
        mark.write_text("{}")
        os.chown(mark, 54321, 54321)
    s = ShmStorage(shm_dir=str(shm), run_id="r2", arena_bytes=1 << 20)
    s.note_run({"durable": True, "run_dir": "/y"})
    s.close()
    assert target.read_text() == "keep" and (mark.is_symlink() or mark.read_text() == "{}")


def test_a_read_of_a_producers_removed_files_fails_its_records_alone(tmp_path):
    import numpy as np

    gone = ShmStorage(shm_dir=str(tmp_path), run_id="r3", arena_bytes=0, inline_max_bytes=0)
    kept = ShmStorage(shm_dir=str(tmp_path), run_id="r3", arena_bytes=0, inline_max_bytes=0)
    h1, h2 = gone.write("u1", {"x": np.ones(100)})["x"], gone.write("u2", {"x": np.ones(100)})["x"]
    h3 = kept.write("u3", {"x": np.full(100, 3.0)})["x"]
    os.unlink(h1.path)  # what a gc did once the producer had ended and `queue.shm_keep_s` had passed
    arrays, failed = kept.read_by_source([h1, h3, h2])
    assert arrays[0] is None and arrays[2] is None and float(arrays[1][0]) == 3.0
    assert list(failed) == [h1.source] and "queue.shm_keep_s" in failed[h1.source]
