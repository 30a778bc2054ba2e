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


def _serve(rx: Receiver, got: list, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
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
        while not silent_got and time.monotonic() < deadline:
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
