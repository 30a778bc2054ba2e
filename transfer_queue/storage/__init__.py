"""Data planes and their factory: `make_storage(config)` picks one by `queue.storage`."""

from __future__ import annotations

from plane_common.net import resolve
from transfer_queue.config import TransferQueueConfig
from transfer_queue.storage.base import Handle, StoragePlane, StorageUnreachable, inline_bytes


def make_storage(config: TransferQueueConfig, storage_address: str | None = None) -> StoragePlane:
    """The plane named by `config.storage`; heavy imports (zmq, nixl) only for the chosen one."""
    bind = resolve(config.bind_host, "queue.bind_host")  # on this process's host: what its listeners bind
    kw = {"max_tensor_bytes": config.max_tensor_bytes, "inline_max_bytes": config.inline_max_bytes,
          "secret": config.secret, "max_frame_bytes": config.max_frame_bytes, "max_connections": config.max_connections}
    if config.storage == "local":
        from transfer_queue.storage.local import LocalStorage

        return LocalStorage(**kw)
    if config.storage == "shm":
        from transfer_queue.storage.shm import ShmStorage

        return ShmStorage(shm_dir=config.shm_dir, run_id=config.run_id, arena_bytes=config.shm_arena_bytes,
                          bind_host=bind, sweep_arenas=config.metadata == "memory", **kw)
    if config.storage == "zmq":
        from transfer_queue.storage.zmq import ZmqStorage

        address = config.storage_address if storage_address is None else storage_address
        return ZmqStorage(address=address, bind_host=bind, data_max_frame_bytes=config.data_max_frame_bytes,
                          read_timeout_s=config.read_timeout_s, **kw)
    if config.storage == "nixl":
        from transfer_queue.storage.nixl import NixlStorage

        return NixlStorage(arena_bytes=config.nixl_arena_bytes, backend=config.nixl_backend,
                           bind_host=bind, read_timeout_s=config.read_timeout_s, **kw)
    raise ValueError(f"queue.storage={config.storage!r}: no such plane")


__all__ = ["Handle", "StoragePlane", "StorageUnreachable", "inline_bytes", "make_storage"]
