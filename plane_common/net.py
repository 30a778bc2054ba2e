"""Where a listener binds, what it advertises, and which interface a process's sockets use.

A plane's host setting (`weights.host`, `queue.bind_host`) is a *spec*, resolved by `resolve` in the process
that binds, on its own host: never one address that every process of a run shares (an address of the
trainer's host cannot be bound on a server's host, and 127.0.0.1 on one host is not 127.0.0.1 on another).

| spec | binds |
|---|---|
| an address (`127.0.0.1`, the default; `10.0.0.5`; `::1`) | that address (one host, or one process) |
| `auto` | this process's node address: `$ASYNCRL_NODE_IP` (asyncrl's Ray actors and controller set Ray's node address there), else the address of the interface of the default route, else 127.0.0.1 |
| `iface:NAME` | the address of interface NAME (e.g. `iface:ib0`: a fast network beside the one Ray uses) |
| a CIDR (`10.0.0.0/16`) | this host's address inside it |

Nothing binds a wildcard (0.0.0.0, ::): a listener is reachable exactly at the address it bound, so what it
advertises to the others (a handle's address, a sender's endpoint, a store's host) is that address, formatted
by `endpoint`. `check_spec` checks a spec's form where a config is loaded (any host); `resolve` finds the
address where the listener runs, and names the key when this host has none that fits.

`socket_ifname(peer)` is the interface a process reaches `peer` by: what `GLOO_SOCKET_IFNAME` /
`NCCL_SOCKET_IFNAME` must name for torch.distributed's own sockets to be reachable from that peer's host
(`socket_env`).
"""

from __future__ import annotations

import ipaddress
import os
import socket

NODE_IP_ENV = "ASYNCRL_NODE_IP"
"""This process's node address, set by asyncrl's Ray actors and controller (Ray's node address): `auto`."""
LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "*", "")
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4 and IPv6 address of this host's interfaces (up or not)."""
    import psutil

    out = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.append((name, a.address.split("%", 1)[0]))
    return out


def _as_address(spec: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(spec)
    except ValueError:
        return None


def _as_network(spec: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    if "/" not in spec:
        return None
    try:
        return ipaddress.ip_network(spec, strict=False)
    except ValueError:
        return None


def check_spec(spec: str, key: str) -> None:
    """ValueError naming `key` unless `spec` is an address, `auto`, `iface:NAME` or a CIDR (never a wildcard)."""
    if not isinstance(spec, str) or spec.strip() in WILDCARDS or spec.strip() != spec:
        raise ValueError(f"{key}={spec!r}: a listener never binds every interface; give an address (127.0.0.1), "
                         "`auto` (each process its node's address), `iface:NAME` or a CIDR (10.0.0.0/16)")
    if spec == "auto" or _as_network(spec) is not None:
        return
    if spec.startswith("iface:") and len(spec) > len("iface:"):
        return
    addr = _as_address(spec)
    if addr is None:
        raise ValueError(f"{key}={spec!r}: expected an address (127.0.0.1), `auto`, `iface:NAME` or a CIDR (10.0.0.0/16)")
    if addr.is_unspecified:
        raise ValueError(f"{key}={spec!r}: a listener never binds every interface; give this host's address, `auto`, "
                         "`iface:NAME` or a CIDR")


def is_loopback(spec: str) -> bool:
    """Whether `spec` binds a loopback address (reachable from its own host only): a loopback address, a
    CIDR inside 127.0.0.0/8 or ::1, or an interface whose address on this host is one (`iface:lo`). `auto`
    is not: each process resolves it to its own node's address."""
    addr = _as_address(spec)
    if addr is not None:
        return addr.is_loopback
    net = _as_network(spec)
    if net is not None:
        return net.subnet_of(ipaddress.ip_network("127.0.0.0/8")) if net.version == 4 else net == ipaddress.ip_network("::1/128")
    if spec.startswith("iface:"):
        try:
            return _as_address(resolve(spec)).is_loopback  # type: ignore[union-attr]
        except ValueError:  # no such interface here: it may be on the other hosts
            return False
    return False


def resolve(spec: str, key: str = "host") -> str:
    """The local address a listener of this process binds for `spec` (see the module docstring)."""
    check_spec(spec, key)
    if spec == "auto":
        node = os.environ.get(NODE_IP_ENV, "")
        if node:
            return node
        return default_route_address() or LOOPBACK
    if spec.startswith("iface:"):
        name = spec[len("iface:"):]
        found = [a for n, a in _addresses() if n == name]
        v4 = [a for a in found if ":" not in a]
        if not found:
            names = sorted({n for n, _ in _addresses()})
            raise ValueError(f"{key}={spec!r}: this host ({socket.gethostname()}) has no interface {name!r} with an "
                             f"address (its interfaces: {names})")
        return (v4 or found)[0]
    net = _as_network(spec)
    if net is not None:
        inside = [a for _, a in _addresses() if (ip := _as_address(a)) is not None and ip.version == net.version and ip in net]
        if not inside:
            mine = sorted(a for _, a in _addresses())
            raise ValueError(f"{key}={spec!r}: no address of this host ({socket.gethostname()}) is inside {spec} "
                             f"(its addresses: {mine})")
        return inside[0]
    return spec


def default_route_address() -> str:
    """The local address of this host's default route ('' without one); no packet is sent."""
    return route_to("192.0.2.1")  # TEST-NET-1: never a real peer, only the routing table is asked


def route_to(peer: str) -> str:
    """The local address this host uses to reach `peer` ('' when no route leads there); no packet is sent."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` ('' if none of this host's does)."""
    for name, a in _addresses():
        if a == address:
            return name
    return ""


def socket_ifname(peer: str) -> str:
    """The interface this host reaches `peer` by ('' when no route leads there)."""
    local = route_to(peer)
    return interface_of(local) if local else ""


def socket_env(peer: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` in `environ` (default: this process's) to the
    interface that reaches `peer`, unless already set (a value the user exported wins); returns the two
    values in force. Call before torch.distributed or NCCL opens its first socket (both read them once)."""
    env = os.environ if environ is None else environ
    name = socket_ifname(peer)
    for var in IFNAME_ENVS:
        if name and not env.get(var):
            env[var] = name
    return {var: env.get(var, "") for var in IFNAME_ENVS}


def endpoint(host: str, port: int, scheme: str = "tcp") -> str:
    """`tcp://host:port`, an IPv6 address in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
