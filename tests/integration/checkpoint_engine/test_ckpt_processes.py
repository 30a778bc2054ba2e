"""The weight plane across real processes, per backend: shm (/dev/shm), gloo (a real
torch.distributed group), nixl (UCX READs between agents in different processes).

One scenario per backend, sharing processes to keep the run short (and, on shm, a receiver whose
kill the sender notices by its connection being gone):
  1. publish v1 to r0, r1 and a slow `victim`; the victim is SIGKILLed mid-update
     -> r0, r1 complete, the sender returns, the victim is reported evicted;
  2. publish v2 with bucket 1 corrupted after its checksum -> refused by r0 and r1,
     reported as `checksum`, their version stays 1;
  3. the victim comes back (late joiner, no weights) and r0, r1 re-join
     -> `sync()` brings all three to v2, byte-exact.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from checkpoint_engine import Sender, WeightsConfig

PROC = Path(__file__).with_name("receiver_proc.py")
ROOT = Path(__file__).resolve().parents[3]


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"model.layers.{i}.mlp.weight": torch.randn(256, 256, generator=g) for i in range(8)}
    sd["model.embed_tokens.weight"] = torch.randn(1000, 512, generator=g).to(torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(256)
    return sd


def digests(sd: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: zlib.crc32(memoryview(v.contiguous().reshape(-1).view(torch.uint8).numpy()))
            for k, v in sd.items()}


def spawn(cfg: WeightsConfig, rid: str, endpoint: str, out: Path, updates: int, slow: float = 0.0):
    cmd = [sys.executable, str(PROC), "--config", json.dumps(asdict(cfg)), "--id", rid,
           "--endpoint", endpoint, "--out", str(out), "--updates", str(updates), "--slow", str(slow)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def publish_and_kill(sender: Sender, victim, progress: Path, why: str):
    """Publish v1 on a thread, SIGKILL `victim` once it received a tensor (its `progress` file);
    the publish's outcome (it must return within 60 s: `why` says what it would have waited for)."""
    result = {}
    pub = threading.Thread(target=lambda: result.update(o=sender.publish(state(1).items(), 1)))
    pub.start()
    deadline = time.monotonic() + 30
    while not progress.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert progress.exists(), "victim never received a tensor"
    victim.send_signal(signal.SIGKILL)
    pub.join(60)
    assert not pub.is_alive(), why
    return result["o"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["shm", "gloo", "nixl"])
def test_kill_checksum_rejoin_across_processes(backend, tmp_path):
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    cfg = WeightsConfig(backend=backend, bucket_size_mb=0.5, timeout_s=2.0)
    sender = Sender(cfg)
    out = {r: tmp_path / f"{r}.jsonl" for r in ("r0", "r1", "victim", "victim2")}
    procs = [spawn(cfg, r, sender.endpoint, out[r], updates=3) for r in ("r0", "r1")]
    victim = spawn(cfg, "victim", sender.endpoint, out["victim"], updates=1, slow=0.2)
    try:
        sender.wait_for(3, timeout_s=150)

        # 1. kill a receiver mid-update
        o1 = publish_and_kill(sender, victim, Path(str(out["victim"]) + ".progress"), "sender blocked by a dead receiver")
        assert o1.completed == ["r0", "r1"] and set(o1.evicted) == {"victim"}

        # the killed server restarts now (late joiner, empty); it joins during step 2
        procs.append(spawn(cfg, "victim", sender.endpoint, out["victim2"], updates=1))

        # 2. a corrupted bucket is refused and reported
        ship = sender._ship

        def corrupt(uid, meta, *args):
            if meta.index == 1:
                sender.transport.slots[meta.slot][100] ^= 0xFF
            ship(uid, meta, *args)

        sender._ship = corrupt
        o2 = sender.publish(state(2).items(), 2)
        sender._ship = ship
        assert o2.evicted == {"r0": "checksum", "r1": "checksum"} and o2.completed == []

        # 3. everyone behind is re-synced
        sender.wait_for(3, timeout_s=150)
        assert sorted(sender.stats()["behind"]) == ["r0", "r1", "victim"]
        o3 = sender.sync(state(2).items())
        assert sorted(o3.completed) == ["r0", "r1", "victim"] and not o3.evicted
        for p in procs:
            assert p.wait(30) == 0
    finally:
        for p in procs + [victim]:
            if p.poll() is None:
                p.kill()
        sender.close()

    want1, want2 = digests(state(1)), digests(state(2))
    for r in ("r0", "r1"):
        first, refused, synced = records(out[r])
        assert first["received"] == 1 and first["digest"] == want1
        assert refused == {"version": 2, "error": "ChecksumError"}
        assert synced["received"] == 2 and synced["digest"] == want2
    assert records(out["victim"]) == []  # killed before it could finish
    (late,) = records(out["victim2"])
    assert late["received"] == 2 and late["digest"] == want2


@pytest.mark.timeout(300)
def test_a_killed_receiver_is_dropped_when_its_connection_closes_not_after_timeout_s(tmp_path):
    """SIGKILL of a receiver's process closes its control connection: the publish drops it once no
    connection holds its id (`disconnected`), not after `weights.timeout_s` (here 120 s, longer than the
    test waits). A receiver restarted under the same id (killed between publishes, its replacement's
    Join pending) is a member again, not dropped for its old connection."""
    cfg = WeightsConfig(backend="shm", bucket_size_mb=0.5, timeout_s=120.0)
    sender = Sender(cfg)
    out = {r: tmp_path / f"{r}.jsonl" for r in ("r0", "victim", "victim2", "victim3")}
    procs = [spawn(cfg, "r0", sender.endpoint, out["r0"], updates=3)]
    victim = spawn(cfg, "victim", sender.endpoint, out["victim"], updates=1, slow=0.2)
    procs.append(victim)

    def restart(name: str, updates: int):
        p = spawn(cfg, "victim", sender.endpoint, out[name], updates=updates)
        procs.append(p)
        deadline = time.monotonic() + 150
        while p.poll() is None and time.monotonic() < deadline:  # joined: live, and behind (it has no weights)
            if "victim" in sender.poll(0.05) and sender.stats()["behind"] == ["victim"]:
                return p
        raise AssertionError(f"{name} did not join")

    try:
        sender.wait_for(2, timeout_s=150)
        o1 = publish_and_kill(sender, victim, Path(str(out["victim"]) + ".progress"), "the publish waited for the dead receiver's timeout")
        assert o1.completed == ["r0"] and o1.evicted == {"victim": "disconnected"}

        second = restart("victim2", updates=2)
        o2 = sender.publish(state(2).items(), 2)
        assert o2.completed == ["r0", "victim"] and not o2.evicted
        second.send_signal(signal.SIGKILL)  # between publishes: its close waits unread ...
        second.wait()
        restart("victim3", updates=1)  # ... while the new one's Join arrives
        o3 = sender.publish(state(3).items(), 3)
        assert o3.completed == ["r0", "victim"] and not o3.evicted, o3
        for p in (procs[0], procs[-1]):
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sender.close()
    assert [r["received"] for r in records(out["r0"])] == [1, 2, 3]
    assert [r["received"] for r in records(out["victim3"])] == [3]
    assert records(out["victim3"])[0]["digest"] == digests(state(3))
