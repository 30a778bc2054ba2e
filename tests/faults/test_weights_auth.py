"""Per-run secret: CURVE on the weight plane's control socket (real ZeroMQ, backend `local`).

A receiver with the secret joins and gets byte-exact weights; one without it, one with a wrong
secret, and a client that knows the server key but not the client key never join, and each
refusal is counted in `Sender.stats()["auth"]`.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import zmq

from checkpoint_engine import Receiver, Sender, WeightsConfig
from checkpoint_engine.wire import Join, encode
from plane_common.curve import curve_keys


def _auth(sender: Sender, key: str, at_least: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while sender.stats()["auth"][key] < at_least and time.monotonic() < deadline:
        sender.poll(0.05)
    return sender.stats()["auth"][key]


@pytest.mark.timeout(30)
def test_only_receivers_with_the_secret_join_and_refusals_are_counted():
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.02, timeout_s=2.0, secret="run-42-secret")
    assert dataclasses.asdict(cfg)["secret"] == "run-42-secret"  # plain fields: travels to actors as a dict
    sender = Sender(cfg)
    rx = Receiver(cfg, "good", endpoint=sender.endpoint)
    plain = Receiver(dataclasses.replace(cfg, secret=""), "plain", endpoint=sender.endpoint)
    wrong = Receiver(dataclasses.replace(cfg, secret="guess"), "wrong", endpoint=sender.endpoint)
    ctx = zmq.Context()
    thief = ctx.socket(zmq.DEALER)  # knows the server's public key, not the client pair
    thief.linger = 0
    thief.identity = b"thief"
    pub, sec = zmq.curve_keypair()
    thief.curve_serverkey, thief.curve_publickey, thief.curve_secretkey = curve_keys(cfg.secret)[0], pub, sec
    thief.connect(sender.endpoint)
    thief.send(encode(Join("thief", -1)))
    try:
        assert sender.wait_for_ids(["good"], timeout_s=10) == []
        assert _auth(sender, "refused", 1) >= 1
        assert _auth(sender, "handshake_failed", 3) >= 3  # plain, wrong and thief all failed theirs
        assert sender.wait_for_ids(["plain", "wrong", "thief"], timeout_s=1.0) == ["plain", "thief", "wrong"]
        assert sender.stats()["live"] == ["good"]

        state = {f"w{i}": torch.randn(30, 30) for i in range(4)}
        got: dict = {}
        t = threading.Thread(target=lambda: got.update({n: x.clone() for n, x in rx.receive(timeout_s=10)}))
        t.start()
        out = sender.publish(state.items(), version=1)
        t.join(10)
        assert out.completed == ["good"] and not out.evicted
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
        assert plain.malformed == wrong.malformed == 0
        with pytest.raises(TimeoutError):
            plain.next_update(timeout_s=0.3)  # nothing ever reaches a peer without the secret
    finally:
        thief.close(0)
        ctx.term()
        for r in (rx, plain, wrong):
            r.close()
        sender.close()


@pytest.mark.timeout(20)
def test_two_secured_senders_in_one_process():
    """Each sender runs its ZAP handler on its own context (a second handler on one context would fail)."""
    cfg = WeightsConfig(backend="local", secret="x")
    a, b = Sender(cfg), Sender(cfg)
    try:
        rx = Receiver(cfg, "r", endpoint=b.endpoint)
        assert b.wait_for_ids(["r"], timeout_s=10) == []
        rx.close()
    finally:
        a.close()
        b.close()
