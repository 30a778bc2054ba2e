"""Sharded publish: every "rank" runs its own Sender and sends its rows of each tensor as pieces; one
receiver of all of them assembles whole tensors (in place into an engine's buffers when given), and
every sender's publish returns once the receiver confirmed the load (`local` backend, real ZeroMQ)."""

import threading

import pytest
import torch

from checkpoint_engine import Sender, ShardedReceiver, WeightsConfig
from checkpoint_engine.receiver import land_into


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(7, 5, generator=g), "b": torch.randn(3, generator=g), "big": torch.randn(300, 40, generator=g)}


def _pieces(state, rank, world):
    """What rank `rank` of `world` sends: its torch.chunk of dim 0 of each tensor, at its byte offset."""
    for name, t in state.items():
        chunk = -(-t.shape[0] // world)
        start = min(rank * chunk, t.shape[0])
        piece = t[start:start + chunk]
        if piece.numel():
            yield name, piece, list(t.shape), start * piece[0].numel() * t.element_size()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_place", [False, True])
def test_receiver_of_two_senders_assembles_the_pieces(in_place):
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=5.0)  # pieces split across buckets too
    senders = [Sender(cfg) for _ in range(2)]
    rx = ShardedReceiver(cfg, "r0", [s.endpoint for s in senders], confirm_loads=True)
    state = _state()
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    got = {}

    def receive():
        update = rx.next_update(timeout_s=10)
        if in_place:
            land_into(update, dest)
        else:
            got.update({n: t.clone() for n, t in update})
        update.confirm()

    th = threading.Thread(target=receive)
    th.start()
    for s in senders:
        s.wait_for(1, timeout_s=5)
    outs = [None, None]
    pubs = [threading.Thread(target=lambda i=i: outs.__setitem__(i, senders[i].publish(_pieces(state, i, 2), version=1)))
            for i in range(2)]
    for p in pubs:
        p.start()
    for p in pubs:
        p.join(20)
    th.join(20)
    assert all(o.completed == ["r0"] and not o.evicted for o in outs)
    assert sum(o.bytes for o in outs) == sum(t.numel() * t.element_size() for t in state.values())
    result = dest if in_place else got
    assert set(result) == set(state) and all(torch.equal(result[k], state[k]) for k in state)
    if in_place:
        assert {k: v.data_ptr() for k, v in dest.items()} == ptrs  # landed in the given buffers, nothing allocated
    assert rx.version == 1
    rx.close()
    for s in senders:
        s.close()


def test_land_into_refuses_what_the_model_does_not_have():
    class Fake:
        def __init__(self, items):
            self.items = items

        def into(self, dest):
            return self

        def __iter__(self):
            return iter(self.items)

    dest = {"w": torch.zeros(2)}
    with pytest.raises(KeyError, match="no parameter 'x'"):
        land_into(Fake([("x", torch.zeros(2))]), dest)
    with pytest.raises(ValueError, match="the model's is"):
        land_into(Fake([("w", torch.zeros(3))]), dest)
    assert land_into(Fake([("w", torch.ones(2)), ("x", torch.ones(1))]), dest, strict=False) == 2
    assert torch.equal(dest["w"], torch.ones(2)) and "x" in dest
