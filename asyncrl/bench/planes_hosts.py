"""`asyncrl bench planes --hosts N`: the planes bench on N simulated hosts (default 3) built on this machine.

Job: on a `SimCluster` (one network, pid, mount and UTS namespace per host, each its own address on a
bridge, /dev/shm, /tmp and Ray node) laid out as the suite's multi-host runs are (`multihost.HostsRun`:
Ray head, controller and a trainer rank on host 0; a trainer rank and a server on host 1; a server and
Redis with a password on host 2), measure:

- what reaches the controller's process (on host 0) of a Ray run whose trainer ranks and servers are
  actors on the other hosts: tensor bytes per step, weight bytes per publish, metadata bytes per
  trajectory, counted as `planes.run_pipeline` counts them (its `--pipeline` child, run on host 0 with
  the cluster's Ray address and the multi-host planes: gloo weights, zmq storage, Redis metadata,
  `weights.host=auto`, `queue.bind_host=auto`). Servers and trainer are the cost models of the
  single-host bench: every byte moves, the compute is a sleep per token;
- its publish (median after the first) against a bare gloo `Sender` on host 0 publishing the same state
  dict to receivers on hosts 1 and 2 over the same bridge, run just before and just after it
  (`host_probes.py`; medians of both sides' publishes after each run's first);
- records and MB per second a consumer on host 0 reads, 64 records per read as a trainer rank reads a
  step, from a producer's zmq storage unit on host 1, against the same with the producer on host 0.

What it does not model: the link is a veth pair on a Linux bridge with no shaping (the kernel copies
packets between namespaces; no wire, NIC or switch latency), and every host shares this machine's cores,
so moving bytes "across hosts" costs CPU the other hosts' processes also want. Ratios against the
one-host baselines say what the planes' own paths cost, not what a real network would.

`--quick`: 8 training steps and 2,000 records instead of 16 and 4,000; the model is the single-host
bench's small size (~10M parameters, 64-token responses) in both. The machine's load average around the
run and the pipeline (`loadavg`), every publish sample and each host's link bytes during the pipeline
(`link_bytes_pipeline`: host 2's rx is every publish's bytes, its server being the only receiver there)
are in the JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from asyncrl.bench.multihost import HostsRun
from asyncrl.bench.report import finish
from asyncrl.bench.sim_cluster import SimCluster, available

LINK = "veth pair on a Linux bridge (one network namespace per host), no shaping"
TARGETS = {"controller_tensor_bytes_per_step": 0, "controller_weight_bytes_per_publish": 0,
           "metadata_bytes_per_trajectory": 2048, "publish_ratio": 0.8}
WEIGHTS_PORT = 29517
"""The bare sender's control port on host 0 (each host has its own ports; outside Ray's worker range)."""
TOKENS = 64
"""Response tokens of the pipeline (the single-host bench's small size)."""
RECORD_TOKENS = 1024
"""Tokens of each data-plane record: a 4 KiB response (int32 ids) and 4 KiB of float32 log-probs."""
BATCH = 64
REPEATS = 11
"""Publishes of each bare run (the first pays the receivers' first-touch page faults and is not counted)."""
PASSES = 10

ModelFn = Callable[[Path], tuple[str, int]]
"""Builds the bench's model under a folder: (its path, its parameter count)."""


def pipeline_overrides(hosts: HostsRun, steps: int) -> list[str]:
    """The single-host bench's run (`planes.overrides`) moved onto the layout: planes that cross hosts."""
    return ["weights.backend=gloo", "queue.storage=zmq", "weights.host=auto", "queue.bind_host=auto",
            "trainer.ray_resources={trainer_slot: 1}", "rollout.ray_resources={server_slot: 1}",
            "queue.metadata=redis", "queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}", "queue.run_id=bench-planes-hosts",
            f"trainer.total_steps={steps}"]


def _json_line(out: subprocess.CompletedProcess, what: str) -> dict[str, Any]:
    if out.returncode != 0:
        raise RuntimeError(f"{what}: exit {out.returncode}\n{(out.stderr or out.stdout or '')[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pipeline(hosts: HostsRun, model: str, steps: int) -> dict[str, Any]:
    """The planes bench's `--pipeline` child, run on host 0 against the cluster's Ray."""
    argv = [sys.executable, "-m", "asyncrl.bench.planes", "--pipeline", model, "--tokens", str(TOKENS),
            "--address", hosts.c.ray_address]
    for kv in pipeline_overrides(hosts, steps):
        argv += ["--set", kv]
    return _json_line(hosts.c.run(0, argv, env=hosts.env(0), timeout=900), "bench planes --pipeline on host 0")


def bare_publish(c: SimCluster, model: str, repeats: int = REPEATS) -> dict[str, Any]:
    """A bare gloo `Sender` on host 0, receivers on hosts 1 and 2 (`host_probes`)."""
    probe = [sys.executable, "-m", "asyncrl.bench.host_probes"]
    endpoint = f"tcp://{c.hosts[0].address}:{WEIGHTS_PORT}"
    rx = [c.popen(i, [*probe, "receiver", endpoint, f"bench-{i}", str(repeats)], stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    try:
        out = _json_line(c.run(0, [*probe, "sender", model, c.hosts[0].address, str(WEIGHTS_PORT), "2", str(repeats)],
                               timeout=300), "bare sender on host 0")
        for p in rx:
            p.communicate(timeout=60)
    finally:
        for p in rx:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def data_plane(c: SimCluster, producer: int, consumer: int, records: int) -> dict[str, Any]:
    """`records` records written into a zmq storage unit on host `producer`, read from host `consumer`."""
    probe = [sys.executable, "-m", "asyncrl.bench.host_probes"]
    handles = c.shared / f"handles-{producer}-{consumer}.msgpack"
    log = open(c.hosts[producer].dir / "producer.log", "w")
    p = c.popen(producer, [*probe, "producer", c.hosts[producer].address, str(records), str(RECORD_TOKENS), str(handles)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready = p.stdout.readline() if p.stdout else ""
        if not ready:
            raise RuntimeError(f"producer on host {producer}: {(c.hosts[producer].dir / 'producer.log').read_text()[-3000:]}")
        out = _json_line(c.run(consumer, [*probe, "consumer", str(handles), str(BATCH), str(PASSES)], timeout=300),
                         f"consumer on host {consumer}")
        return {**out, "write_s": json.loads(ready)["write_s"]}
    finally:
        if p.stdin:
            p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def placement(hosts: HostsRun) -> dict[str, list[int]]:
    """The hosts each trainer rank and server of the run lived on (the GCS keeps dead actors)."""
    where: dict[str, set[int]] = {}
    for a in hosts.where():
        if a["class"] in ("TrainerRankActor", "ServerActor") and a["host"]:
            where.setdefault(a["class"], set()).add(hosts.host_of(a["host"]))
    return {k: sorted(v) for k, v in sorted(where.items())}


def run(n: int, quick: bool, model_fn: ModelFn) -> dict[str, Any]:
    steps, records = (8, 2000) if quick else (16, 4000)
    load = {"start": _loadavg()}
    with SimCluster(n) as c:
        hosts = HostsRun(c)
        try:
            t0 = time.monotonic()
            hosts.start()
            up_s = time.monotonic() - t0
            model, params = model_fn(hosts.models)
            before = bare_publish(c, model)
            link0 = [hosts.link_bytes(i) for i in range(n)]
            load["pipeline"] = [_loadavg()]
            pipe = pipeline(hosts, model, steps)
            load["pipeline"].append(_loadavg())
            link1 = [hosts.link_bytes(i) for i in range(n)]
            where = placement(hosts)
            after = bare_publish(c, model)
            across = data_plane(c, producer=1, consumer=0, records=records)
            one = data_plane(c, producer=0, consumer=0, records=records)
        finally:
            hosts.close()
    load["end"] = _loadavg()
    link = [{"rx": b[0] - a[0], "tx": b[1] - a[1]} for a, b in zip(link0, link1)]
    return assemble(n, params, pipe, before, after, across, one, where, link, cluster_up_s=round(up_s, 1), loadavg=load)


def _loadavg() -> list[float]:
    """1, 5 and 15 minute load averages of the machine (shared by every simulated host, and other jobs)."""
    return [round(x, 2) for x in os.getloadavg()]


def assemble(n: int, params: int, pipe: dict[str, Any], before: dict[str, Any], after: dict[str, Any],
             across: dict[str, Any], one: dict[str, Any], where: dict[str, list[int]], link: list[dict[str, int]],
             **extra: Any) -> dict[str, Any]:
    """The bench's figures and targets from what each part measured (pure: the unit tests build it)."""
    bare = before["publish_s_each"][1:] + after["publish_s_each"][1:]  # after each run's first (first-touch faults)
    publish_s_bare = round(statistics.median(bare), 4)
    res: dict[str, Any] = {
        "hosts": n, "link": LINK, "params": params, "response_tokens": TOKENS, "steps": pipe["steps"],
        "controller_tensor_bytes_per_step": pipe["controller_tensor_bytes_per_step"],
        "controller_weight_bytes_per_publish": pipe["controller_weight_bytes_per_publish"],
        "metadata_bytes_per_trajectory": pipe["metadata_bytes_per_trajectory"],
        "publish_s_pipeline": pipe["publish_s_pipeline"], "publish_s_pipeline_each": pipe["publish_s_pipeline_each"],
        "sender_s_pipeline_each": pipe["sender_s_pipeline_each"], "gather_s_pipeline": pipe["gather_s_pipeline"],
        "publish_s_bare": publish_s_bare, "publish_s_bare_each": bare,
        "publish_ratio": round(publish_s_bare / pipe["publish_s_pipeline"], 3), "publish_bytes": after["bytes"],
        "records_per_s": across["records_per_s"], "data_mb_per_s": across["data_mb_per_s"],
        "records_per_s_one_host": one["records_per_s"], "data_mb_per_s_one_host": one["data_mb_per_s"],
        "records_per_s_ratio": round(across["records_per_s"] / one["records_per_s"], 3),
        "data_plane": {"records": across["records"], "bytes": across["bytes"], "records_per_read": across["batch"],
                       "read_s_each": across["read_s_each"], "read_s_each_one_host": one["read_s_each"]},
        "placement": where, "link_bytes_pipeline": link, "controller_peak_rss_mb": pipe["controller_peak_rss_mb"],
        "rank_read_bytes_per_step": pipe["rank_read_bytes_per_step"], **extra,
    }
    measured = {k: res[k] for k in TARGETS}
    res["targets"] = {k: {"target": t, "measured": measured[k],
                          "met": measured[k] >= t if k == "publish_ratio" else measured[k] <= t}
                      for k, t in TARGETS.items()}
    return res


def print_table(res: dict[str, Any]) -> None:
    print(f"asyncrl bench planes --hosts {res['hosts']}: {res['params'] / 1e6:.1f}M params, {res['response_tokens']}-token "
          f"responses, {res['steps']} steps; link: {res['link']}")
    print(f"placement (host index): {res['placement']}")
    rows = [
        ("tensor bytes into the controller per step", res["controller_tensor_bytes_per_step"]),
        ("weight bytes into the controller per publish", res["controller_weight_bytes_per_publish"]),
        ("metadata bytes per trajectory", res["metadata_bytes_per_trajectory"]),
        ("publish s: pipeline (median after the first)", res["publish_s_pipeline"]),
        ("publish s: bare gloo Sender, host 0 -> hosts 1, 2", res["publish_s_bare"]),
        ("publish ratio bare / pipeline", res["publish_ratio"]),
        ("data plane records/s, host 1 -> host 0", res["records_per_s"]),
        ("data plane MB/s, host 1 -> host 0", res["data_mb_per_s"]),
        ("data plane records/s, one host", res["records_per_s_one_host"]),
        ("records/s across hosts / one host", res["records_per_s_ratio"]),
    ]
    for name, value in rows:
        print(f"{name:<52}{value!s:>14}")
    print(f"publish_s pipeline {res['publish_s_pipeline_each']} (of it in the sender {res['sender_s_pipeline_each']}), "
          f"bare {res['publish_s_bare_each']}")
    if "loadavg" in res:
        print(f"load average (1, 5, 15 min): {res['loadavg']}")
    for name, t in res["targets"].items():
        print(f"target {name} {t['target']}: measured {t['measured']} -> {'met' if t['met'] else 'NOT met'}")


def main(n: int, quick: bool, as_json: bool, model_fn: ModelFn) -> int:
    why = available()
    if why:
        print(f"asyncrl bench planes --hosts: {why}", file=sys.stderr)
        return 2
    t0 = time.time()
    return finish(run(n, quick, model_fn), t0, as_json, print_table)
