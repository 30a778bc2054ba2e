"""What the multi-host fault tests read of a run while it goes: its metrics and fleet events, the hosts of its
live servers, and waiting for a condition or for its end (killed past a timeout)."""

from __future__ import annotations

import json
import time

TIMEOUT_S = 10
FAULT_RUN = ("weights.backend=gloo", "queue.storage=zmq", "rollout.placement_strategy=SPREAD", "queue.read_timeout_s=15",
             f"weights.timeout_s={TIMEOUT_S}", "trainer.save_every=4")


def rows(hosts, name: str) -> list[dict]:
    path = hosts.run_dir(name) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def events(hosts, name: str) -> list[dict]:
    path = hosts.run_dir(name) / "fleet_events.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def step(hosts, name: str) -> int:
    return max([r.get("step", 0) for r in rows(hosts, name)] or [-1])


def server_hosts(hosts) -> list[int]:
    return sorted(hosts.host_of(a["host"]) for a in hosts.where() if a["state"] == "ALIVE" and a["class"] == "ServerActor")


def wait_for(proc, what: str, check, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if check():
            return
        time.sleep(1)
    out = proc.communicate(timeout=30)[0] if proc.poll() is not None else ""
    proc.kill()
    raise AssertionError(f"{what} did not happen: {out[-3000:]}")


def output(proc, timeout_s: float = 300) -> str:
    """`proc`'s output once it ended (killed past `timeout_s`)."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
