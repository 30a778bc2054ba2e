"""A receiver that joins and then never reads costs one timeout in all, not one per publish.

Real Sender and Receivers (backend `local`, real ZeroMQ, threads): `silent` is a Receiver whose
owner never calls `next_update`. After its first timeout it is a suspect; re-joining (a new
Receiver with the same id) gets it a probe it does not answer, so later publishes do not wait
for it. Once it reads, it answers the probe, is live again and `sync()` brings it current.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from checkpoint_engine import Receiver, Sender, WeightsConfig


def _state(v: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((32, 32), float(v * 10 + i)) for i in range(4)}


def _serve(rx: Receiver, got: list, stop: threading.Event, delay_s: float = 0.0) -> threading.Thread:
    """Read every update `rx` is sent; `delay_s` before each read: an engine that is busy, not hung."""
    def run() -> None:
        while not stop.is_set():
            time.sleep(delay_s)
            try:
                update = rx.next_update(timeout_s=0.1)
            except TimeoutError:
                continue
            got.append((update.version, {n: t.clone() for n, t in update}))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(30)
def test_silent_rejoiner_costs_one_timeout_then_returns_after_answering_the_probe():
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=1.0)
    sender = Sender(cfg)
    stop = threading.Event()
    good_got: list = []
    good = Receiver(cfg, "good", endpoint=sender.endpoint)
    _serve(good, good_got, stop)
    silent = Receiver(cfg, "silent", endpoint=sender.endpoint)  # joins, never reads
    assert sender.wait_for_ids(["good", "silent"], timeout_s=10) == []
    try:
        out1 = sender.publish(_state(1).items(), version=1)
        assert out1.completed == ["good"] and out1.evicted == {"silent": "timeout"}
        assert out1.seconds >= 1.0  # the one timeout it costs
        assert sender.stats()["suspect"] == ["silent"]

        silent.close()
        silent = Receiver(cfg, "silent", endpoint=sender.endpoint)  # joins again, still never reads
        time.sleep(0.2)
        for v in (2, 3, 4):
            out = sender.publish(_state(v).items(), version=v)
            assert out.completed == ["good"] and out.evicted == {}
            assert out.seconds < 0.9 * cfg.timeout_s  # not waited for
        assert "silent" not in sender.stats()["live"]

        silent_got: list = []
        _serve(silent, silent_got, stop)  # it reads now: answers the probe
        assert sender.wait_for_ids(["silent"], timeout_s=5) == []
        assert sender.stats()["suspect"] == [] and sender.membership.behind() == ["silent"]
        out = sender.sync(_state(4).items())
        assert out.completed == ["silent"] and out.version == 4
        deadline = time.monotonic() + 5
        while (not silent_got or len(good_got) < 4) and time.monotonic() < deadline:  # acked before recorded
            time.sleep(0.01)
        v, tensors = silent_got[-1]
        assert v == 4 and all(torch.equal(tensors[k], t) for k, t in _state(4).items())
        assert [v for v, _ in good_got] == [1, 2, 3, 4]
    finally:
        stop.set()
        time.sleep(0.2)
        sender.close()
        good.close()
        silent.close()


@pytest.mark.timeout(30)
def test_a_receiver_restarted_under_its_id_as_an_update_begins_takes_part_in_it():
    """The restarted process's Join reaches the sender after the update began (its old entry was
    still a member, the Begin went nowhere): before any bucket it is sent the Begin again and loads
    the version, instead of being evicted as `rejoined` (which cost a fleet's restart another server)."""
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=10.0)
    sender = Sender(cfg)
    stop = threading.Event()
    got: dict[str, list] = {"a": [], "b": [], "b2": []}
    a, b = Receiver(cfg, "a", endpoint=sender.endpoint), Receiver(cfg, "b", endpoint=sender.endpoint)
    _serve(a, got["a"], stop)
    b_stop = threading.Event()
    _serve(b, got["b"], b_stop)
    fresh = None
    try:
        assert sender.wait_for_ids(["a", "b"], timeout_s=10) == []
        assert sender.publish(_state(1).items(), version=1).completed == ["a", "b"]
        b_stop.set()
        time.sleep(0.2)
        b.close()  # its process died; nothing told the sender
        result: dict = {}
        pub = threading.Thread(target=lambda: result.update(o=sender.publish(_state(2).items(), version=2)))
        pub.start()
        time.sleep(0.1)  # the update waits on the old entry now
        fresh = Receiver(cfg, "b", endpoint=sender.endpoint)
        _serve(fresh, got["b2"], stop)
        pub.join(20)
        out = result["o"]
        assert out.evicted == {} and sorted(out.completed) == ["a", "b"]
        assert out.seconds < 0.5 * cfg.timeout_s
        deadline = time.monotonic() + 5  # the load is acknowledged before the serving thread records it
        while not got["b2"] and time.monotonic() < deadline:
            time.sleep(0.01)
        v, tensors = got["b2"][-1]
        assert v == 2 and all(torch.equal(tensors[k], t) for k, t in _state(2).items())
    finally:
        stop.set()
        time.sleep(0.2)
        sender.close()
        a.close()
        if fresh is not None:
            fresh.close()


@pytest.mark.timeout(30)
def test_a_sync_for_a_restarted_receiver_waits_for_its_connection_not_the_dead_ones_entry():
    """A server restarted under the id of one that died: until its Join is read, the dead process's
    entry stands for it, live but unreachable. `wait_for_ids(connected=True)` (what a re-sync of a
    restarted server runs first) waits for the new connection, so the sync that follows sends the
    version to the new process instead of evicting the dead entry as `disconnected` after ~1 s
    (a restart on a loaded machine joined 1-2 s late and failed that way, three times in a row)."""
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=10.0)
    sender = Sender(cfg)
    stop = threading.Event()
    got: list = []
    old = Receiver(cfg, "b", endpoint=sender.endpoint)
    fresh = None
    try:
        assert sender.wait_for_ids(["b"], timeout_s=10) == []
        old_stop = threading.Event()
        _serve(old, [], old_stop)
        assert sender.publish(_state(1).items(), version=1).completed == ["b"]
        old_stop.set()
        time.sleep(0.2)
        old.close()  # died; its entry is still live
        deadline = time.monotonic() + 30  # until the sender's socket has seen the connection go (slow on a loaded host)
        while sender._connected("b"):
            assert time.monotonic() < deadline, "the closed receiver's connection never went"
            time.sleep(0.05)

        def late_restart() -> None:
            nonlocal fresh
            time.sleep(1.5)  # slower than the sender's two liveness looks
            fresh = Receiver(cfg, "b", endpoint=sender.endpoint)
            _serve(fresh, got, stop)

        threading.Thread(target=late_restart, daemon=True).start()
        t0 = time.monotonic()
        assert sender.wait_for_ids(["b"], timeout_s=10, connected=True) == []
        assert time.monotonic() - t0 >= 1.4
        out = sender.sync(_state(1).items(), receivers=["b"], resend=True)
        assert out.completed == ["b"] and out.evicted == {}
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got[-1][0] == 1
    finally:
        stop.set()
        time.sleep(0.2)
        sender.close()
        if fresh is not None:
            fresh.close()



@pytest.mark.timeout(60)
def test_a_hung_receiver_is_evicted_as_a_straggler_not_after_timeout_s_and_a_slow_one_is_not():
    """`weights.straggler_s`: a connected receiver that never answers (a hung server) holds a publish
    `straggler_s` once the others answered, not `timeout_s`; one that is slower but answers is kept."""
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=20.0, straggler_s=0.5)
    sender = Sender(cfg)
    stop = threading.Event()
    got: dict[str, list] = {"a": [], "b": [], "slow": []}
    rxs = {rid: Receiver(cfg, rid, endpoint=sender.endpoint) for rid in ("a", "b", "slow", "hung")}
    _serve(rxs["a"], got["a"], stop)
    _serve(rxs["b"], got["b"], stop)
    _serve(rxs["slow"], got["slow"], stop, 0.15)  # within the grace: kept
    assert sender.wait_for_ids(list(rxs), timeout_s=10) == []
    try:
        out = sender.publish(_state(1).items(), version=1)
        assert sorted(out.completed) == ["a", "b", "slow"] and out.evicted == {"hung": "straggler"}
        assert out.seconds < 0.25 * cfg.timeout_s  # the grace, not the timeout
        assert sender.stats()["suspect"] == ["hung"]  # a rejoin must answer a probe first
        out = sender.publish(_state(2).items(), version=2)
        assert sorted(out.completed) == ["a", "b", "slow"] and out.evicted == {}
        deadline = time.monotonic() + 5
        while len(got["slow"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [v for v, _ in got["slow"]] == [1, 2]
    finally:
        stop.set()
        time.sleep(0.3)
        sender.close()
        for rx in rxs.values():
            rx.close()


@pytest.mark.timeout(60)
def test_straggler_s_0_gives_a_silent_receiver_the_whole_timeout():
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=1.5, straggler_s=0.0)
    sender = Sender(cfg)
    stop = threading.Event()
    got: list = []
    rxs = {rid: Receiver(cfg, rid, endpoint=sender.endpoint) for rid in ("a", "b", "hung")}
    _serve(rxs["a"], got, stop)
    _serve(rxs["b"], [], stop)
    assert sender.wait_for_ids(list(rxs), timeout_s=10) == []
    try:
        out = sender.publish(_state(1).items(), version=1)
        assert sorted(out.completed) == ["a", "b"] and out.evicted == {"hung": "timeout"}
        assert out.seconds >= cfg.timeout_s
    finally:
        stop.set()
        time.sleep(0.3)
        sender.close()
        for rx in rxs.values():
            rx.close()


@pytest.mark.timeout(60)
def test_a_sync_to_a_server_that_died_since_it_joined_holds_the_trainer_seconds_not_the_timeout():
    """The fleet re-syncs a server (or syncs a restarted one) right after it joined: if its process dies in
    between, the trainer's sync waits `SYNC_JOIN_S` for its connection, not `weights.timeout_s` (20 s here),
    and reports it not loaded; a live receiver of the same sync is brought current all the same."""
    from asyncrl.trainer.rank import SYNC_JOIN_S, TrainerRank
    from tests.integration.fleet.weights import StateEngine

    cfg = WeightsConfig(backend="local", timeout_s=20.0)
    engine = StateEngine(list(_state(1).items()))
    rank = TrainerRank(engine, plane=None, weights=cfg)
    stop, got = threading.Event(), []
    live = Receiver(cfg, "live", endpoint=rank.endpoint)
    gone = Receiver(cfg, "gone", endpoint=rank.endpoint)
    threads = [_serve(live, got, stop), _serve(gone, [], stop)]
    try:
        out = rank.publish(1, ["live", "gone"])
        assert sorted(out["completed"]) == ["gone", "live"]
        stop.set()
        for t in threads:
            t.join()
        gone.close()  # its process died after it joined
        stop.clear()
        threads = [_serve(live, got, stop)]
        engine.state = list(_state(2).items())
        t0 = time.monotonic()
        out = rank.sync(["live", "gone"], resend=True)
        took = time.monotonic() - t0
        assert out["completed"] == ["live"] and "gone" in out["evicted"]
        assert took < SYNC_JOIN_S + 5.0 < cfg.timeout_s
        stop.set()  # the receiver acks its last bucket before its thread records the update: let it finish
        threads[0].join()
        assert got[-1][0] == 1 and torch.equal(got[-1][1]["w0"], _state(2)["w0"])  # the current weights, resent
    finally:
        stop.set()
        for t in threads:
            t.join()
        live.close()
        rank.close()
