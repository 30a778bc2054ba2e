"""The figures of a status snapshot as Prometheus text (exposition format 0.0.4).

Job: turn one snapshot (with `liveness`) into gauges named like its JSON keys
(`asyncrl_queue_depth{state="ready"}`, `asyncrl_staleness{view="queue",staleness="1"}`, ...)
and serve them from `asyncrl status --watch --prometheus PORT` on 127.0.0.1, or on the address
`--prometheus-host` names (a pod's own address, for `deploy/kuberay/status-service.yaml`; never a wildcard).
Boundary: the watcher's latest snapshot is the only input; prometheus_client writes the text
(label values escaped: a server or fleet name may hold any character) and serves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from prometheus_client import generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from plane_common.net import LOOPBACK, resolve

HELP = {
    "up": "1 while the run reports (not dead, stalled, finished or failed)",
    "trainer_step": "trainer steps taken", "version": "the policy version the servers were asked to load",
    "weights_last_publish_s": "seconds the last publish took", "weights_last_publish_time": "unix time of the last publish",
    "queue_capacity": "queue capacity (records)", "queue_resident": "records in the queue",
    "queue_complete_groups": "complete groups in the queue", "idle_ratio": "share of the wall time a component waited",
    "queue_depth": "the trainer's records by state", "staleness": "samples by staleness (queue, last batch, trained)",
    "drops": "drops by cause", "rate": "throughputs per second", "heartbeat_age_s": "seconds since a component last made progress",
    "server_version": "version a server serves", "server_in_flight": "requests in flight on a server",
    "server_tokens_per_s": "tokens per second of a server", "server_healthy": "1 when a server answers its health probe",
    "weights_parity_max_abs": "max-abs log-prob gap between a server and the trainer on the weight-parity probe",
    "server_arena_waits": "writes of a server's samples that found its data-plane arena full and waited",
    "server_arena_wait_s": "seconds those writes waited", "server_arena_waiting": "writes waiting for arena space now",
    "data_plane_arena_waits": "writes that found the controller's data-plane arena full and waited",
    "data_plane_arena_wait_s": "seconds those writes waited",
    "data_plane_arena_waiting": "writes waiting for the controller's arena now",
    "undelivered_frees": "frees the controller sent that a producer's free endpoint did not get",
    "mismatch": "the latest trainer step's training-inference mismatch (docs/algorithms.md), by figure",
    "mismatch_step": "the trainer step the mismatch figures are of",
}


class _Gauges:
    """Gauge families in first-seen order; every sample of a family has the same label names."""

    def __init__(self) -> None:
        self.families: dict[str, GaugeMetricFamily] = {}

    def add(self, name: str, value: Any, **labels: Any) -> None:
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = GaugeMetricFamily(f"asyncrl_{name}", HELP.get(name, name), labels=list(labels))
        fam.add_metric([str(v) for v in labels.values()], float(value or 0))


def gauges(snap: dict[str, Any]) -> list[GaugeMetricFamily]:
    """The snapshot's figures as gauge families (only `asyncrl_up` for a lifecycle record)."""
    g = _Gauges()
    if "queue" not in snap:
        g.add("up", snap.get("liveness", {}).get("alive", False))
        return list(g.families.values())
    q, tr, w, st, ro = snap["queue"], snap["trainer"], snap["weights"], snap["staleness"], snap["rollout"]
    g.add("up", snap["liveness"]["alive"])
    g.add("trainer_step", tr["step"])
    g.add("version", tr["version"])
    g.add("weights_last_publish_s", w["last_publish_s"])
    g.add("weights_last_publish_time", w["last_publish_time"])
    for key in ("capacity", "resident", "complete_groups"):
        g.add(f"queue_{key}", q[key])
    g.add("idle_ratio", tr["idle_ratio"], component="trainer")
    g.add("idle_ratio", ro["idle_ratio"], component="rollout")
    for s in ("ready", "leased", "waiting", "acked"):
        g.add("queue_depth", q[s], state=s)
    for view in ("queue", "last_batch", "trained"):
        for k, v in st[view].items():
            g.add("staleness", v, view=view, staleness=k)
    for k, v in snap["drops"].items():
        g.add("drops", v, cause=k, unit="groups")
    for k, v in q["drops"].items():
        g.add("drops", v, cause=k, unit="records")
    for k, v in snap["rates"].items():
        g.add("rate", v, kind=k)
    for fleet, f in snap["fleets"].items():
        for key in ("size", "target"):
            if f.get(key) is not None:
                g.add(f"fleet_{key}", f[key], fleet=fleet)
        for s in f["servers"]:
            for key in ("version", "in_flight", "tokens_per_s", "healthy"):
                g.add(f"server_{key}", s[key], fleet=fleet, server=s["name"])
            for key in ("arena_waits", "arena_wait_s", "arena_waiting"):
                if key in s:  # snapshots of older runs do not have them
                    g.add(f"server_{key}", s[key], fleet=fleet, server=s["name"])
            if s.get("parity_max_abs") is not None:
                g.add("weights_parity_max_abs", s["parity_max_abs"], fleet=fleet, server=s["name"])
    dp = snap.get("data_plane", {})
    for key in ("arena_waits", "arena_wait_s", "arena_waiting"):
        if key in dp:
            g.add(f"data_plane_{key}", dp[key])
    for r in dp.get("undelivered_frees", []):
        g.add("undelivered_frees", r["frees"], endpoint=r["endpoint"], producer=r["producer"])
    for k, v in snap["liveness"]["component_age_s"].items():
        g.add("heartbeat_age_s", v, component=k)
    mm = snap.get("mismatch") or {}  # absent before the first step and in older runs' snapshots
    if "step" in mm:
        g.add("mismatch_step", mm["step"])
    for k, v in mm.items():
        if k != "step":
            g.add("mismatch", v, figure=k)
    return list(g.families.values())


class SnapshotCollector(Collector):
    """A collector over whatever snapshot `latest()` returns at scrape time."""

    def __init__(self, latest: Callable[[], dict[str, Any]]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from gauges(self.latest())


def _registry(latest: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(latest))
    return registry


def render(snap: dict[str, Any]) -> str:
    return generate_latest(_registry(lambda: snap)).decode()


def serve(port: int, latest: Callable[[], dict[str, Any]], host: str = LOOPBACK) -> Any:
    """Serve the figures of `latest()` at http://HOST:PORT/metrics in a daemon thread; returns the server
    (`server_address`, `shutdown()`). `host` is a listener spec as `queue.bind_host` takes it (an address,
    `auto`, `iface:NAME`, a CIDR), resolved here; a wildcard is refused (`ValueError`)."""
    server, _thread = start_http_server(port, addr=resolve(host, "--prometheus-host"), registry=_registry(latest))
    return server
