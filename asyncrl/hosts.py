"""A run over several hosts: what each process knows of its own host, and which placements the planes
cannot serve.

`on_node` is what a Ray actor (a trainer rank, a rollout server) and the controller do first: record
their node's address, which the planes' `auto` host resolves to (`plane_common.net`), and point
torch.distributed's own sockets (gloo, NCCL) at the interface that reaches their peer.

`check_placement` is the one rule of where the planes' ends may run, asked twice: before anything starts,
with the hosts each role *may* land on (the Ray nodes that offer its resources), where only a placement that
cannot work is an error; and once the trainer ranks and the servers run, with the hosts they landed on.
A plane that does not cross hosts (`queue.storage` shm, `weights.backend` shm or cuda_ipc) needs the
trainer ranks and the servers on one host; a loopback listener address (`weights.host`, `queue.bind_host`
127.0.0.1) needs them there too, and the queue's also the controller, which frees what they hold.

    check_placement(cfg, trainer={"10.0.0.1"}, servers={"10.0.0.2"}, controller="10.0.0.1")
    -> ConfigError: queue.storage=shm: ... the trainer ranks run on 10.0.0.1 and the servers on 10.0.0.2 ...
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from asyncrl.config import ConfigError
from plane_common.net import NODE_IP_ENV, is_loopback, socket_env


def on_node(node_ip: str, peer: str) -> str:
    """Record this process's node address for the planes' `auto` (`ASYNCRL_NODE_IP`, unless set) and set
    `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` to the interface that reaches `peer` (unless set: a value
    exported on the node wins). Returns the interface in force ('' when none was found), which the
    callers log."""
    os.environ.setdefault(NODE_IP_ENV, node_ip)
    return socket_env(peer)["GLOO_SOCKET_IFNAME"]


def _hosts(addresses: Iterable[str]) -> str:
    return ", ".join(sorted(set(addresses))) or "no host"


def placement_errors(cfg: Any, trainer: set[str], servers: set[str], controller: str, verb: str = "run") -> list[str]:
    """Why the planes of `cfg` cannot serve trainer ranks on the hosts `trainer` and servers on `servers`
    (node addresses) with the controller on `controller`; empty if they can."""
    out = []
    apart = len(trainer | servers) > 1
    where = f"the trainer ranks {verb} on {_hosts(trainer)} and the servers on {_hosts(servers)}"
    pin = "(or place both on one host: trainer.ray_resources / rollout.ray_resources)"
    if apart and not cfg.queue.crosses_hosts:
        out.append(f"queue.storage={cfg.queue.storage}: this data plane does not cross hosts and {where}; "
                   f"use queue.storage=zmq or nixl {pin}")
    if apart and not cfg.weights.crosses_hosts:
        out.append(f"weights.backend={cfg.weights.backend}: this weight plane does not cross hosts and {where}; "
                   f"use weights.backend=gloo, nccl or nixl {pin}")
    fix = "(each process binds its node's address), iface:NAME or a CIDR"
    if apart and is_loopback(cfg.weights.host):
        out.append(f"weights.host={cfg.weights.host}: a loopback address is reached from its own host only and {where}; "
                   f"set weights.host=auto {fix}")
    if len(trainer | servers | {controller}) > 1 and is_loopback(cfg.queue.bind_host):
        out.append(f"queue.bind_host={cfg.queue.bind_host}: a loopback address is reached from its own host only and {where}, "
                   f"the controller on {controller}; set queue.bind_host=auto {fix}")
    return out


def check_placement(cfg: Any, trainer: set[str], servers: set[str], controller: str, may: bool = False) -> None:
    """ConfigError naming the key if the planes of `cfg` cannot serve this placement. With `may`, `trainer`
    and `servers` are the hosts each role may land on, and only a placement that fails wherever they land
    is an error (checked again with the hosts they landed on, once they run)."""
    if not trainer or not servers:
        return
    verb = "run"
    if may:
        # the most favourable landing: both roles (and the controller, for the queue's listeners) on one host
        common = trainer & servers
        best = (common & {controller}) or common
        if best:
            host = sorted(best)[0]
            trainer, servers = {host}, {host}
        verb = "can only run"  # the Ray nodes that offer each role's bundle (resources, GPUs)
    errors = placement_errors(cfg, trainer, servers, controller, verb)
    if errors:
        raise ConfigError(errors[0])
