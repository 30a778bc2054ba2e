"""Sender/receiver semantics on the in-process `local` backend (receivers are threads;
the control plane is real ZeroMQ)."""

import threading

import pytest
import torch

from checkpoint_engine import ChecksumError, Receiver, Sender, UpdateAborted, WeightsConfig


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(64, 48, generator=g) for i in range(6)}


def _cfg(**kw) -> WeightsConfig:
    return WeightsConfig(backend="local", bucket_size_mb=0.02, timeout_s=1.0, **kw)


class Server(threading.Thread):
    """Receives `n` updates; records each (version, tensors) or the error it raised."""

    def __init__(self, cfg, rid, endpoint, n=1, stall_after=None):
        super().__init__(daemon=True)
        self.rx = Receiver(cfg, rid, endpoint=endpoint)
        self.n, self.stall_after, self.results = n, stall_after, []
        self.start()

    def run(self):
        for _ in range(self.n):
            try:
                update = self.rx.next_update(timeout_s=20)
                got = {}
                for i, (name, t) in enumerate(update):
                    if self.stall_after is not None and i == self.stall_after and not self.results:
                        threading.Event().wait(3.0)  # a stuck engine: stops consuming
                    got[name] = t.clone()
                self.results.append((self.rx.version, got))
            except (ChecksumError, UpdateAborted) as e:
                self.results.append((self.rx.version, e))


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(30)
def test_publish_reaches_all_and_versions_only_grow():
    cfg = _cfg()
    sender = Sender(cfg)
    servers = [Server(cfg, f"r{i}", sender.endpoint, n=2) for i in range(3)]
    sender.wait_for(3, timeout_s=10)
    out1 = sender.publish(_state(1).items(), version=1)
    out2 = sender.publish(_state(2).items(), version=2)
    for s in servers:
        s.join(10)
    assert out1.completed == ["r0", "r1", "r2"] and not out1.evicted and out1.buckets > 2
    for s in servers:
        (v1, g1), (v2, g2) = s.results
        assert (v1, v2) == (1, 2) and _same(g1, _state(1)) and _same(g2, _state(2))
    with pytest.raises(ValueError, match="must exceed"):
        sender.publish(_state(3).items(), version=2)
    sender.close()


@pytest.mark.timeout(30)
def test_late_joiner_gets_current_weights_via_sync():
    cfg = _cfg()
    sender = Sender(cfg, state_fn=lambda: _state(5).items())
    early = Server(cfg, "early", sender.endpoint)
    sender.wait_for(1, timeout_s=10)
    sender.publish(_state(5).items(), version=5)
    assert sender.sync() is None  # nobody behind
    late = Server(cfg, "late", sender.endpoint)
    sender.wait_for(2, timeout_s=10)
    out = sender.sync()
    late.join(10), early.join(10)
    assert out.completed == ["late"] and out.version == 5
    assert late.results[0][0] == 5 and _same(late.results[0][1], _state(5))
    assert sender.stats()["behind"] == []
    sender.close()


@pytest.mark.timeout(30)
def test_checksum_mismatch_is_refused_and_reported():
    cfg = _cfg()
    sender = Sender(cfg)
    ship = sender._ship

    def corrupt_bucket_1(uid, meta, *args):  # flips a byte after the checksum was computed
        if meta.index == 1:
            sender.transport.slots[meta.slot][7] ^= 0xFF
        ship(uid, meta, *args)

    sender._ship = corrupt_bucket_1
    server = Server(cfg, "r0", sender.endpoint, n=2)
    sender.wait_for(1, timeout_s=10)
    out = sender.publish(_state(1).items(), version=1)
    assert out.evicted == {"r0": "checksum"} and out.completed == []
    sender._ship = ship
    sender.wait_for(1, timeout_s=10)  # the refusing receiver joins again, still behind
    assert sender.stats()["behind"] == ["r0"]
    out = sender.sync(_state(1).items())
    server.join(10)
    (v_bad, err), (v_ok, got) = server.results
    assert isinstance(err, ChecksumError) and v_bad == -1
    assert v_ok == 1 and _same(got, _state(1)) and out.completed == ["r0"]
    sender.close()


@pytest.mark.timeout(30)
def test_stalled_receiver_is_evicted_without_blocking_others_then_resyncs():
    cfg = _cfg()
    sender = Sender(cfg)
    good = Server(cfg, "good", sender.endpoint, n=2)
    stuck = Server(cfg, "stuck", sender.endpoint, n=2, stall_after=2)
    sender.wait_for(2, timeout_s=10)
    out = sender.publish(_state(1).items(), version=1)
    assert out.completed == ["good"] and out.evicted == {"stuck": "timeout"}
    assert out.seconds < 5.0  # bounded by timeout_s, not by the stuck engine
    stuck_result = None
    for _ in range(100):  # the stuck engine wakes up, learns it was dropped, joins again
        if stuck.results:
            stuck_result = stuck.results[0]
            break
        threading.Event().wait(0.1)
    assert stuck_result is not None and isinstance(stuck_result[1], UpdateAborted)
    sender.wait_for(2, timeout_s=10)
    out2 = sender.publish(_state(2).items(), version=2)
    good.join(10), stuck.join(10)
    assert sorted(out2.completed) == ["good", "stuck"]
    assert stuck.results[1][0] == 2 and _same(stuck.results[1][1], _state(2))
    sender.close()
