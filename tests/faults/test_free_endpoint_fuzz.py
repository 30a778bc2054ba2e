"""Fuzz the arena's free endpoint (the socket a producer with an shm or nixl arena opens for the
frees its consumers send): 10,000 malformed or forged messages over a real ZeroMQ socket, mixed
with real frees. Nothing crashes or hangs, no slot is freed that was not exactly allocated, and
every refusal is counted (a malformed message by the endpoint, a forged release by the arena)."""

import random
import time

import msgpack
import numpy as np
import pytest
import zmq

from plane_common import curve
from transfer_queue.storage.arena import Arena, FreeEndpoint, FreeSender, aligned


def _wait(cond, timeout=20.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("secret", ["", "s3cret"])
def test_free_endpoint_survives_10k_malformed_and_forged_frees(secret):
    arena = Arena(np.zeros(1 << 20, dtype=np.uint8), "fuzz")
    endpoint = FreeEndpoint(arena.release, "127.0.0.1", secret)
    sender = FreeSender(secret)
    rng = random.Random(0)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    if secret:  # a peer holding the secret, sending garbage over the authenticated socket
        curve.client(raw, secret, 1 << 24)
    raw.connect(endpoint.address)
    live = [arena.alloc(4096, timeout=1.0) for _ in range(8)]  # (offset, slot) of real allocations
    used = arena.used
    malformed = forged = 0
    try:
        for i in range(10_000):
            kind = i % 5
            if kind == 0:
                raw.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))))
                malformed += 1
            elif kind == 1:
                raw.send(msgpack.packb(rng.choice([{"a": 1}, [1, 2], [[1, 2]], [[-1, 4096, 1]], [[1.5, 2, 3]], "x", [[True, 1, 1]]])))
                malformed += 1
            elif kind == 2:
                raw.send_multipart([msgpack.packb([["x"]]), b"tail"])  # first part malformed; the tail is a message too
                malformed += 2
            else:  # well formed, forged: offsets of a live slot with a wrong slot number, or nothing allocated there
                off, slot = rng.choice(live)
                raw.send(msgpack.packb([[off, aligned(4096), slot ^ (1 + rng.randrange(1 << 20))], [1 << 19, 64, 7]]))
                forged += 2
        _wait(lambda: endpoint.rejected + arena.rejected >= malformed + forged)
        assert endpoint.rejected == malformed and arena.rejected == forged
        assert arena.used == used, "a forged free released a live slot"
        # real frees still work, through the framework's own sender
        sender.send({endpoint.address: [[off, aligned(4096), slot] for off, slot in live]})
        _wait(lambda: arena.used == 0)
        assert endpoint._thread.is_alive()
    finally:
        raw.close(0)
        ctx.term()
        sender.close()
        endpoint.close()
