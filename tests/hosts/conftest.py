"""The suite's cluster of simulated hosts (`asyncrl/bench/sim_cluster.py`), one per test session: four hosts,
each a network, pid, mount and UTS namespace with its own address, /dev/shm, /tmp and Ray node, laid out
by `asyncrl/bench/multihost.py`:

    host 0: Ray head, the controller, trainer rank        (trainer_slot)
    host 1: trainer rank, rollout server                  (trainer_slot, server_slot, fault_slot)
    host 2: rollout server, Redis with a password         (server_slot)
    host 3: rollout server of the fault tests             (fault_slot); its clocks run an hour ahead

The fault tests place their servers with `fault_slot` (one on each of hosts 1 and 3) and cut or kill host
3, which holds nothing else. Host 3's CLOCK_MONOTONIC (a time namespace) and Python's `time.time()` are
3600 s ahead of the others'. Where namespaces cannot be made (not root, no iproute2 / util-linux), every
test here skips with the reason.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from asyncrl.bench.multihost import HostsRun
from asyncrl.bench.sim_cluster import SimCluster, available

SKEW_S = 3600.0
"""Host 3's clocks run this far ahead."""


class FourHosts(HostsRun):
    def resources(self) -> list[dict[str, float]]:
        out = super().resources()
        out[1]["fault_slot"] = 1
        out[3] = {"host3": 4, "any_host": 1, "fault_slot": 1}
        return out


@pytest.fixture(scope="session")
def hosts() -> Iterator[FourHosts]:
    why = available()
    if why:
        pytest.skip(why)
    with SimCluster(4, skew_s=[0, 0, 0, SKEW_S]) as cluster:
        run = FourHosts(cluster)
        try:
            run.start()
            yield run
        finally:
            run.close()
