"""The TransferQueue client: what producers and consumers call (sync and asyncio).

A client pairs a metadata store (chosen by `queue.metadata`, reached over ZeroMQ or
Redis when it lives elsewhere) with a data plane (`queue.storage`). `put` writes tensors
to the plane once and hands only their handles to the store; `get` returns metadata and
handles; `fetch` turns handles into tensors (views of the plane's memory where it
allows); `ack` finishes a batch for its consumer group. It holds no queue state itself:
any number of clients, in any processes, share one queue.

    # RUN_ID: the queue's own (the service prints it); every process of one queue is given the same
    client = connect(TransferQueueConfig(storage="shm", controller_address="tcp://127.0.0.1:5555", run_id=RUN_ID))
    client.put([Record("u0", "g0", group_size=1, version=3, tensors={"response_ids": ids})])
    batch = client.get("trainer", num_groups=1, max_staleness=2, current_version=4, timeout=10)
    tensors = client.fetch(batch, ["response_ids"])     # [{"response_ids": tensor}]
    client.ack(batch)
"""

from __future__ import annotations

import asyncio
from typing import Any

from transfer_queue.codec import as_output
from transfer_queue.config import TransferQueueConfig
from transfer_queue.metadata.base import FreeHook, GetRequest, MetadataStore, default_consumer_id
from transfer_queue.records import Batch, QueueStats, Record, SampleMeta
from transfer_queue.storage import StoragePlane, make_storage


def write_record(storage: StoragePlane, record: Record) -> SampleMeta:
    """Write one record's tensors to `storage` (once) and return what the metadata store keeps:
    everything but the bytes. The producer's half of `put`, for producers that hand the
    metadata to the controller themselves (e.g. as the reply of a remote call)."""
    record.validate()
    handles = storage.write(record.uid, record.tensors)
    return SampleMeta(record.uid, record.group_id, record.group_size, record.version, dict(record.meta), handles, record.sealed)


def make_metadata(config: TransferQueueConfig, on_free: FreeHook | None = None) -> MetadataStore:
    """The metadata store named by `config.metadata` (and `controller_address`)."""
    if config.metadata == "redis":
        from transfer_queue.metadata.redis import RedisController

        return RedisController(config, on_free=on_free)
    if config.controller_address:
        from transfer_queue.service import RemoteController

        return RemoteController(config.controller_address, secret=config.secret, max_frame_bytes=config.max_frame_bytes)
    from transfer_queue.metadata.memory import MemoryController

    return MemoryController(config.capacity, config.consumer_groups, config.lease_timeout_s, on_free=on_free)


class TransferQueueClient:
    """Producer and consumer verbs over one metadata store and one data plane."""

    def __init__(self, config: TransferQueueConfig, *, metadata: MetadataStore | None = None,
                 storage: StoragePlane | None = None, consumer_id: str = "") -> None:
        self.config = config
        self.consumer_id = consumer_id or default_consumer_id()
        self._owns_storage = storage is None
        """`close` closes the data plane only when this client made it: one passed in is its maker's (a run's
        plane outlives the queue clients of its segments: a trainer restart makes a new one on the same plane)."""
        if metadata is None and config.metadata == "memory" and not config.controller_address:
            self.storage = storage or make_storage(config)
            self.metadata = make_metadata(config, on_free=self.storage.free)
        else:
            self.metadata = metadata or make_metadata(config, on_free=storage.free if storage else None)
            if storage is None:
                address = None
                if config.storage == "zmq" and not config.storage_address and config.controller_address:
                    address = self.metadata.call("info", {}).storage_address  # type: ignore[attr-defined]
                storage = make_storage(config, storage_address=address)
                if config.metadata == "redis":
                    self.metadata.on_free = storage.free  # type: ignore[attr-defined]
            self.storage = storage

    # ---- producers -------------------------------------------------------
    def put(self, records: list[Record], timeout: float | None = None) -> None:
        """Write tensors once, then add the records; waits while the queue is full."""
        samples: list[SampleMeta] = []
        try:
            for r in records:
                samples.append(write_record(self.storage, r))
        except BaseException:
            self.discard(samples)
            raise
        self.add(samples, timeout)

    def add(self, samples: list[SampleMeta], timeout: float | None = None) -> None:
        """Add records whose tensors are already in a plane (`write_record`, any process);
        waits while the queue is full. On failure their tensors are freed."""
        try:
            self.metadata.put(samples, self.config.put_timeout_s if timeout is None else timeout, self.consumer_id)
        except BaseException:
            self.discard(samples)
            raise

    def discard(self, samples: list[SampleMeta]) -> None:
        """Free the tensors of records that will never be added (or were refused)."""
        self.storage.free([h for s in samples for h in s.handles.values()])

    def update(self, uid: str, tensors: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
               seal: bool = True) -> None:
        """Add fields to a record already put (e.g. the reward after the response)."""
        handles = self.storage.write(uid, tensors or {})
        try:
            self.metadata.update(uid, handles, meta, seal, self.consumer_id)
        except BaseException:
            self.storage.free(list(handles.values()))
            raise

    # ---- consumers -------------------------------------------------------
    def get(self, consumer: str, *, num_groups: int | None = None, num_samples: int | None = None,
            group_size: int | None = None, fields: list[str] | None = None, max_staleness: int | None = None,
            current_version: int | None = None, max_version: int | None = None, timeout: float | None = 0.0,
            allow_partial: bool = False, lineage: list[list[int]] | None = None) -> Batch:
        """Whole groups ready for `consumer` (metadata + handles, no tensor bytes), leased
        until `ack`; an empty batch if none fitted within `timeout` seconds. `lineage`: the
        consumer's resumes, along which staleness is measured (`rules.staleness`)."""
        return self.metadata.get(GetRequest(consumer, self.consumer_id, num_groups, num_samples, group_size, fields,
                                            max_staleness, current_version, max_version, timeout, allow_partial,
                                            lineage))

    def fetch(self, batch: Batch, fields: list[str] | None = None, as_torch: bool = True) -> list[dict[str, Any]]:
        """Tensors of each sample of `batch` (all its fields, or `fields`), in batch order."""
        wanted = [(i, f, s.handles[f]) for i, s in enumerate(batch.samples) for f in (fields or s.handles)]
        arrays = self.storage.read([h for _, _, h in wanted])
        out: list[dict[str, Any]] = [{} for _ in batch.samples]
        for (i, f, h), arr in zip(wanted, arrays):
            out[i][f] = as_output(arr, h.dtype, as_torch)
        return out

    def ack(self, batch: Batch) -> int:
        """Finish `batch` for its consumer group; freed once every group is done with it."""
        return self.metadata.ack(batch.consumer, batch.uids, self.consumer_id)

    def nack(self, batch: Batch) -> int:
        """Give `batch` back now: its groups go to the next `get` of the same consumer group."""
        return self.metadata.nack(batch.consumer, batch.lease_id, batch.uids, self.consumer_id)

    def drop(self, batch: Batch, cause: str = "filtered", records_only: bool = False) -> int:
        """Finish `batch` without training on it, counted under `cause` (`failed`, `filtered`, `stale`,
        `unreadable`); `records_only`: its records alone, the rest of their groups consumed (`MetadataStore.drop`)."""
        if records_only:
            return self.metadata.drop(batch.consumer, batch.uids, cause, self.consumer_id, records_only=True)
        return self.metadata.drop(batch.consumer, batch.uids, cause, self.consumer_id)

    def renew(self, batch: Batch) -> bool:
        """Extend the lease of a batch still being worked on."""
        return self.metadata.renew(batch.consumer, batch.lease_id, batch.uids, self.consumer_id)

    def stats(self) -> QueueStats:
        return self.metadata.stats()

    def close(self) -> None:
        self.metadata.close()
        if self._owns_storage:
            self.storage.close()


class AsyncTransferQueueClient:
    """The same verbs as coroutines; each call runs on a worker thread of the event loop."""

    def __init__(self, config: TransferQueueConfig, **kw: Any) -> None:
        self.sync = TransferQueueClient(config, **kw)

    async def put(self, records: list[Record], timeout: float | None = None) -> None:
        await asyncio.to_thread(self.sync.put, records, timeout)

    async def add(self, samples: list[SampleMeta], timeout: float | None = None) -> None:
        await asyncio.to_thread(self.sync.add, samples, timeout)

    async def discard(self, samples: list[SampleMeta]) -> None:
        await asyncio.to_thread(self.sync.discard, samples)

    async def update(self, uid: str, tensors: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                     seal: bool = True) -> None:
        await asyncio.to_thread(self.sync.update, uid, tensors, meta, seal)

    async def get(self, consumer: str, **kw: Any) -> Batch:
        return await asyncio.to_thread(lambda: self.sync.get(consumer, **kw))

    async def fetch(self, batch: Batch, fields: list[str] | None = None, as_torch: bool = True) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.fetch, batch, fields, as_torch)

    async def ack(self, batch: Batch) -> int:
        return await asyncio.to_thread(self.sync.ack, batch)

    async def nack(self, batch: Batch) -> int:
        return await asyncio.to_thread(self.sync.nack, batch)

    async def drop(self, batch: Batch, cause: str = "filtered", records_only: bool = False) -> int:
        return await asyncio.to_thread(self.sync.drop, batch, cause, records_only)

    async def renew(self, batch: Batch) -> bool:
        return await asyncio.to_thread(self.sync.renew, batch)

    async def stats(self) -> QueueStats:
        return await asyncio.to_thread(self.sync.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)


def connect(config: TransferQueueConfig | None = None, **kw: Any) -> TransferQueueClient:
    """A client for `config` (defaults: in-process memory controller, shm plane)."""
    return TransferQueueClient(config or TransferQueueConfig(), **kw)
