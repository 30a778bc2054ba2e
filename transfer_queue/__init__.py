"""TransferQueue: the data plane between rollout fleets and the trainer.

A metadata queue (records, GRPO groups, versions, per-consumer-group delivery and acks)
with tensors kept in a separate data plane and handed out as handles. Standalone: it
imports nothing from `asyncrl` or `agents`, and nothing from Ray.

    from transfer_queue import Record, TransferQueueConfig, connect
    q = connect(TransferQueueConfig(storage="shm"))
    q.put([Record("u0", "g0", tensors={"x": np.ones(4)})])
    batch = q.get("trainer", num_groups=1)
    q.fetch(batch); q.ack(batch)

Backends (`queue.metadata`): memory (`MemoryController`, served by `ControllerService`),
redis (`RedisController`). Planes (`queue.storage`): local, shm, zmq, nixl.
"""

from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient, connect, make_metadata, write_record
from transfer_queue.codec import WireError
from transfer_queue.config import TransferQueueConfig
from transfer_queue.metadata.base import GetRequest, MetadataStore
from transfer_queue.records import Batch, QueueStats, Record, SampleMeta
from transfer_queue.storage import StoragePlane, make_storage

__all__ = [
    "AsyncTransferQueueClient", "Batch", "GetRequest", "MetadataStore", "QueueStats", "Record", "SampleMeta",
    "StoragePlane", "TransferQueueClient", "TransferQueueConfig", "WireError", "connect", "make_metadata",
    "make_storage", "write_record",
]
