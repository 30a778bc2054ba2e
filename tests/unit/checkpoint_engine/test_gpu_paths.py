"""The weight plane's GPU-only decisions, checked on CPU: which device a bare `cuda` means, what an
NCCL group is built with, the host-bounded wait on a collective (the same code for gloo and NCCL,
exercised here with real gloo groups), the abort of a group that is replaced after an eviction, and
the device the sender's packing thread sets.

What cannot exist here is CUDA itself: where a test needs `torch.cuda.*` or `ProcessGroupNCCL`,
it replaces exactly those with stand-ins (said in its docstring); everything else is real.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from checkpoint_engine import Receiver, Sender, UpdateAborted, WeightsConfig
from checkpoint_engine.backends import base, gloo_nccl
from checkpoint_engine.backends.gloo_nccl import CollectiveSenderTransport, wait_bounded


def _fake_cuda(monkeypatch, current: int = 3) -> list:
    """Stand-ins for the CUDA calls (no CUDA here): `current_device` returns `current`,
    `set_device` records (device, thread name)."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name)))
    return calls


def test_a_bare_cuda_is_the_current_device(monkeypatch):
    """`torch.cuda.current_device` is a stand-in (no CUDA here)."""
    _fake_cuda(monkeypatch, current=3)
    assert base.resolve_device("cuda") == torch.device("cuda", 3)
    assert base.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert base.resolve_device("cpu") == torch.device("cpu")
    assert base.pack_device(WeightsConfig(backend="nccl", device="cuda")) == 3
    assert base.pack_device(WeightsConfig(backend="cuda_ipc", device="cuda:1")) == 1
    assert base.pack_device(WeightsConfig(backend="shm")) == 3  # the caller uses CUDA: its device


def test_no_cuda_no_pack_device():
    assert base.pack_device(WeightsConfig(backend="shm")) is None


class _FakeNCCL:
    """Stands in for `dist.ProcessGroupNCCL`, which a CPU build of torch lacks; `connect` is what
    the eager communicator init does (block on an event to play a rank that never joins)."""

    made: list["_FakeNCCL"] = []
    connect = staticmethod(lambda device: None)

    class Options:
        def __init__(self):
            self._timeout = None

    def __init__(self, store, rank, world, opts):
        self.rank, self.world, self.opts, self.aborted, self.connected = rank, world, opts, 0, None
        self.error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")  # what torch reads here
        _FakeNCCL.made.append(self)

    def eager_connect_single_device(self, device):
        _FakeNCCL.connect(device)
        self.connected = device

    def abort(self):
        self.aborted += 1


def test_an_nccl_group_sets_an_indexed_device_and_its_watchdog_comes_after_the_deadline(monkeypatch):
    """CUDA calls and `ProcessGroupNCCL` are stand-ins (no CUDA here); the store is real."""
    calls = _fake_cuda(monkeypatch, current=2)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    _FakeNCCL.made = []
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    cfg = WeightsConfig(backend="nccl", device="cuda", timeout_s=5.0)
    pg = gloo_nccl._new_group(cfg, base.resolve_device(cfg.device), dist.HashStore(), 1, 0, 2, "127.0.0.1")
    assert calls == [(torch.device("cuda", 2), threading.current_thread().name)]  # not a bare `cuda` (ValueError)
    assert pg.connected == torch.device("cuda", 2)  # the communicator is built in form_group, not at the first bucket
    assert pg.opts._timeout > datetime.timedelta(seconds=cfg.timeout_s)
    assert pg.error_handling == "2" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # restored


@pytest.mark.timeout(30)
def test_an_nccl_group_a_rank_never_joins_is_aborted_within_the_timeout(monkeypatch):
    """CUDA calls and `ProcessGroupNCCL` are stand-ins (no CUDA here): the eager init blocks as a
    real one does while a rank is missing."""
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    never = threading.Event()
    monkeypatch.setattr(_FakeNCCL, "connect", staticmethod(lambda device: never.wait(10)))
    _FakeNCCL.made = []
    cfg = WeightsConfig(backend="nccl", device="cuda:0", timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not every rank joined"):
        gloo_nccl._new_group(cfg, torch.device("cuda", 0), dist.HashStore(), 4, 1, 3, "127.0.0.1")
    assert time.monotonic() - t0 < 2.0
    assert _FakeNCCL.made[-1].aborted == 1
    never.set()


def _gloo_pair(timeout_s: float) -> tuple:
    store = dist.HashStore()

    def make(rank):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2, opts)

    pgs: dict = {}
    t = threading.Thread(target=lambda: pgs.__setitem__(1, make(1)))
    t.start()
    pgs[0] = make(0)
    t.join()
    return pgs[0], pgs[1]


def _bcast(pg, tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return pg.broadcast([tensor], opts)


@pytest.mark.timeout(30)
def test_the_bounded_wait_aborts_a_broadcast_a_member_never_joins():
    """Real gloo groups; gloo's own timeout (10 s) is far past the deadline, as NCCL's watchdog is."""
    root, peer = _gloo_pair(timeout_s=10.0)
    aborted = []
    real_abort = dist.ProcessGroupGloo.abort
    with mock.patch.object(dist.ProcessGroupGloo, "abort", lambda self: aborted.append(self) or real_abort(self)):
        src = torch.arange(16, dtype=torch.float32)
        work = _bcast(root, src)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="group aborted"):
            wait_bounded(root, work, 0.3)
        assert 0.3 <= time.monotonic() - t0 < 2.0 and aborted == [root]
        dst = torch.zeros(16)
        _bcast(peer, dst).wait()  # the late member frees the root's op (no 10 s teardown)
        # and a complete broadcast passes through the same wait
        src2, dst2 = torch.full((4,), 7.0), torch.zeros(4)
        w_root, w_peer = _bcast(root, src2), _bcast(peer, dst2)
        wait_bounded(peer, w_peer, 5.0)
        wait_bounded(root, w_root, 5.0)
        assert torch.equal(dst2, src2) and len(aborted) == 1


def test_a_replaced_or_closed_group_is_aborted():
    """Real gloo groups of the sender alone (world 1)."""
    aborted = []
    real_abort = dist.ProcessGroupGloo.abort
    with mock.patch.object(dist.ProcessGroupGloo, "abort", lambda self: aborted.append(self) or real_abort(self)):
        tx = CollectiveSenderTransport(WeightsConfig(backend="gloo", bucket_size_mb=0.01, timeout_s=5.0))
        tx.form_group(1, 1)
        first = tx.pg
        tx.form_group(2, 1)  # after an eviction: the survivors' group replaces it
        assert aborted == [first] and tx.pg is not first
        second = tx.pg
        tx.close()
        assert aborted == [first, second]


class _Server(threading.Thread):
    """A receiver thread; `stall` stops consuming after the first tensor (its engine hangs, so it never
    joins the next broadcast)."""

    def __init__(self, cfg, rid, endpoint, stall=False):
        super().__init__(daemon=True)
        self.rx, self.stall, self.result, self.release = Receiver(cfg, rid, endpoint=endpoint), stall, None, threading.Event()
        self.start()

    def run(self):
        try:
            got = {}
            for name, t in self.rx.next_update(timeout_s=20):
                got[name] = t.clone()
                if self.stall:
                    self.release.wait(20)
            self.result = got
        except (UpdateAborted, RuntimeError) as e:
            self.result = e


@pytest.mark.timeout(60)
def test_a_stalled_member_is_evicted_its_group_aborted_and_the_survivor_completes():
    """Real Sender, receivers and gloo groups in one process (receivers are threads)."""
    cfg = WeightsConfig(backend="gloo", bucket_size_mb=0.01, timeout_s=0.5, checksum=False)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(32, 32, generator=g) for i in range(4)}  # 4 KiB each: 4 buckets
    aborted = []
    real_abort = dist.ProcessGroupGloo.abort
    sender = Sender(cfg)
    with mock.patch.object(dist.ProcessGroupGloo, "abort", lambda self: aborted.append(self) or real_abort(self)):
        ok, stuck = _Server(cfg, "ok", sender.endpoint), _Server(cfg, "stuck", sender.endpoint, stall=True)
        try:
            sender.wait_for(2, timeout_s=10)
            t0 = time.monotonic()
            out = sender.publish(state.items(), version=1)
            seconds = time.monotonic() - t0
        finally:
            stuck.release.set()
            sender.close()
    ok.join(10)
    stuck.join(10)
    assert out.completed == ["ok"] and out.evicted == {"stuck": "timeout"} and seconds < 10
    assert set(ok.result) == set(state) and all(torch.equal(ok.result[k], state[k]) for k in state)
    assert len(aborted) >= 2  # the sender's group with the stuck member, then the survivors' group at close


@pytest.mark.timeout(30)
def test_the_packing_thread_sets_the_callers_cuda_device(monkeypatch):
    """Real Sender and receiver (`local` backend); the CUDA calls are stand-ins (no CUDA here): the
    caller's current device is 1, as under torchrun with LOCAL_RANK=1."""
    calls = _fake_cuda(monkeypatch, current=1)
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.01, timeout_s=5.0)
    sender = Sender(cfg)
    server = _Server(cfg, "r0", sender.endpoint)
    try:
        sender.wait_for(1, timeout_s=10)
        out = sender.publish({"w": torch.ones(8, 8)}.items(), version=1)
    finally:
        sender.close()
    server.join(10)
    assert out.completed == ["r0"]
    assert calls == [(1, "weights-pack")]


def test_device_backends_synchronize_the_stream_before_announcing_and_acknowledging(monkeypatch):
    """Real nixl and gloo transports (built on CPU); their device is then set to a GPU and the CUDA
    stream is a stand-in (no CUDA here) that records `synchronize`."""
    pytest.importorskip("nixl_cu12")
    from checkpoint_engine.backends.gloo_nccl import CollectiveReceiverTransport
    from checkpoint_engine.backends.nixl import NixlReceiverTransport, NixlSenderTransport
    from checkpoint_engine.wire import BucketMeta

    synced: list = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synced.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    meta = BucketMeta(index=0, slot=0, nbytes=0, checksum=None)
    nixl_cfg = WeightsConfig(backend="nixl", bucket_size_mb=0.01)
    gloo_cfg = WeightsConfig(backend="gloo", bucket_size_mb=0.01)
    senders = [NixlSenderTransport(nixl_cfg), CollectiveSenderTransport(gloo_cfg)]
    receivers = [NixlReceiverTransport(nixl_cfg), CollectiveReceiverTransport(gloo_cfg)]
    transports = senders + receivers

    def hooks():
        for tx in senders:
            tx.seal(meta)  # the slot is filled: before the bucket is announced
        for rx in receivers:
            rx.release(meta)  # reads are done: before the bucket is acknowledged

    try:
        hooks()
        assert synced == []  # on CPU: nothing to wait for
        gpu = torch.device("cuda", 1)
        for tx in transports:
            tx.device = gpu
        hooks()
        assert synced == [gpu] * 4
    finally:
        for tx in transports:
            tx.close()
