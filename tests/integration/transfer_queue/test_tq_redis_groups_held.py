"""`RedisController.groups_held`: which groups the durable queue holds (what a resumed producer asks
so as not to generate again a group that reached the queue before it died)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import Record, TransferQueueConfig, connect


@pytest.mark.timeout(60)
def test_groups_held_names_the_groups_put_and_not_yet_finished(tmp_path):
    server = RedisServer(str(tmp_path))
    try:
        q = connect(TransferQueueConfig(metadata="redis", redis_url=server.url, storage="local", run_id="held"))
        q.put([Record(f"{g}-{i}", g, group_size=2, tensors={"x": np.arange(3)}) for g in ("a", "b") for i in range(2)])
        q.put([Record("c-0", "c", group_size=2, tensors={"x": np.arange(3)})])  # incomplete: held too
        assert q.metadata.groups_held(["a", "b", "c", "never"]) == {"a", "b", "c"}
        batch = q.get("trainer", num_groups=1, timeout=2)
        assert q.metadata.groups_held(["a", "b"]) == {"a", "b"}  # leased, not acked: still held
        q.ack(batch)
        assert q.metadata.groups_held(["a", "b", "c"]) == {"a", "b", "c"} - set(batch.group_ids)
        assert q.metadata.groups_held([]) == set()
        q.close()
    finally:
        server.stop()
