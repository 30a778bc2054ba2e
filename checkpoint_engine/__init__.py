"""checkpoint_engine: the weight plane, trainer -> rollout servers.

Bucketed, double-buffered broadcast of a state dict with versions, checksums and
eviction of receivers that die or stall. Standalone: imports nothing from `asyncrl`.

    from checkpoint_engine import Receiver, Sender, WeightsConfig
    cfg = WeightsConfig(backend="shm", bucket_size_mb=64)
    sender = Sender(cfg)                                       # trainer process
    rx = Receiver(cfg, "server-0", endpoint=sender.endpoint)   # each rollout server
    sender.wait_for(1, timeout_s=10)
    sender.publish(model.state_dict().items(), version=1)      # trainer
    for name, tensor in rx.receive(): ...                      # server (its own thread/process)
"""

from checkpoint_engine.config import BACKENDS, WeightsConfig
from checkpoint_engine.membership import Membership, UpdateOutcome
from checkpoint_engine.receiver import ChecksumError, Receiver, Update, UpdateAborted
from checkpoint_engine.sender import Sender
from checkpoint_engine.sharded import ShardedReceiver, ShardedUpdate

__all__ = [
    "BACKENDS", "ChecksumError", "Membership", "Receiver", "Sender", "ShardedReceiver", "ShardedUpdate", "Update",
    "UpdateAborted", "UpdateOutcome", "WeightsConfig",
]
