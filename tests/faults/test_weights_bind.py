"""Every listener of the weight plane binds `weights.host` (127.0.0.1), never every interface.

Reads the process's listening sockets (psutil) before and after a real gloo publish (sender's
control socket, its TCP store, gloo's pair listeners on both ends) and a `shm` sender.
"""

from __future__ import annotations

import threading

import psutil
import pytest
import torch

from checkpoint_engine import Receiver, Sender, WeightsConfig


def _listeners() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_listeners_bind_the_configured_host_only(backend):
    before = _listeners()
    cfg = WeightsConfig(backend=backend, bucket_size_mb=0.02, timeout_s=10.0)
    sender = Sender(cfg)
    rx = Receiver(cfg, "r0", endpoint=sender.endpoint)
    state = {f"w{i}": torch.randn(50, 50) for i in range(3)}
    got: dict = {}
    try:
        assert sender.wait_for_ids(["r0"], timeout_s=10) == []
        t = threading.Thread(target=lambda: got.update({n: x.clone() for n, x in rx.receive(timeout_s=20)}))
        t.start()
        out = sender.publish(state.items(), version=1)
        t.join(20)
        assert out.completed == ["r0"] and all(torch.equal(got[k], state[k]) for k in state)
        new = _listeners() - before
        assert ("127.0.0.1", sender.port) in new
        if backend == "gloo":
            assert ("127.0.0.1", sender.transport.store.port) in new
            assert len(new) >= 3  # control socket, store, gloo pair listener(s)
        assert {ip for ip, _ in new} == {"127.0.0.1"}, new
    finally:
        rx.close()
        sender.close()
