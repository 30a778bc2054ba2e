"""Fuzz: 10,000+ malformed frames from raw DEALERs into a live Sender while a real Receiver is
joined and real publishes run (backend `local`, real ZeroMQ sockets, threads).

Asserts: no exception out of the sender, no hang, every publish completes for the real receiver
with byte-identical tensors, and the sender's malformed count is exactly what was sent (by
reason where the reason is fixed by construction). Frames over `max_message_bytes` are dropped
by ZeroMQ itself (the peer is disconnected) and are never counted.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch
import zmq

from checkpoint_engine import Receiver, Sender, WeightsConfig
from tests.faults.test_weights_malformed import RANDOM_REASONS, dealers, evict_ghost, frames, wait_malformed

N_FRAMES = 12_000


def _state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {f"layer{i}.w": torch.randn(40, 40, generator=g) for i in range(5)}


@pytest.mark.timeout(60)
def test_fuzzed_sender_keeps_publishing_intact_bytes_and_counts_every_frame():
    t0 = time.monotonic()
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.02, timeout_s=1.0, max_message_bytes=256 << 10)
    sender = Sender(cfg)
    ctx = zmq.Context()
    socks = dealers(ctx, sender.endpoint)
    evict_ghost(sender, socks["ghost"])  # a known non-member: its acks name updates that never were

    rx = Receiver(cfg, "real", endpoint=sender.endpoint)
    got: list[tuple[int, dict[str, torch.Tensor]]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                update = rx.next_update(timeout_s=0.2)
            except TimeoutError:
                continue
            got.append((update.version, {n: t.clone() for n, t in update}))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    assert sender.wait_for_ids(["real"], timeout_s=10) == []

    sent: Counter = Counter()
    errors: list[BaseException] = []

    def fuzz() -> None:
        try:
            rng = random.Random(1234)
            for i, (who, parts, reason) in enumerate(frames(rng, N_FRAMES)):
                socks[who].send_multipart(parts)
                sent[reason] += 1
                if i % 2000 == 0:  # beyond ZMQ_MAXMSGSIZE: ZeroMQ drops the peer, nothing counted
                    big = ctx.socket(zmq.DEALER)
                    big.linger = 0
                    big.identity = b"fuzz-big"
                    big.connect(sender.endpoint)
                    big.send(b"\x00" * (300 << 10))
                    time.sleep(0.01)
                    big.close(0)
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    fuzzer = threading.Thread(target=fuzz, daemon=True)
    fuzzer.start()
    version, outcomes = 0, []
    while fuzzer.is_alive() or version < 5:
        version += 1
        outcomes.append(sender.publish(_state(version).items(), version=version))
    fuzzer.join(30)
    assert not errors and not fuzzer.is_alive()
    assert version > 5  # publishes ran while the frames came in

    stats = wait_malformed(sender, N_FRAMES)
    stop.set()
    server.join(5)
    try:
        assert all(o.completed == ["real"] and not o.evicted for o in outcomes)
        assert [v for v, _ in got] == list(range(1, version + 1))
        for v, tensors in got:
            want = _state(v)
            assert set(tensors) == set(want) and all(torch.equal(tensors[k], want[k]) for k in want)
        assert stats["malformed_total"] == N_FRAMES  # every frame counted once, the oversized ones not at all
        by_reason = stats["malformed"]
        for reason, n in sent.items():
            if reason is not None and reason not in RANDOM_REASONS:
                assert by_reason.get(reason, 0) == n, reason
        fixed_random = sum(n for r, n in sent.items() if r in RANDOM_REASONS)
        assert sum(by_reason.get(r, 0) for r in RANDOM_REASONS) == fixed_random + sent[None]
        assert rx.malformed == 0 and stats["live"] == ["real"]
        assert time.monotonic() - t0 < 45
    finally:
        for s in socks.values():
            s.close(0)
        ctx.term()
        rx.close()
        sender.close()
