"""Requests to a running job from outside it (`asyncrl scale`), and the run's answers.

A request is a small typed record (`ScaleRequest`) dropped where the controller looks for it: a file
in the run directory (`RUN_DIR/control/`, the run's own 0700 folder: only its user can ask) or, for a
cluster run watched through Redis, a list under the run's name (Redis AUTH is the gate, as for the
run's status). The controller takes the requests about once a second (`take`), applies them in
order, and answers each one in `RUN_DIR/control/<id>.json` (and under the run's Redis name), which
`asyncrl scale --wait` reads back. Nothing here acts: the fleet's size is the `FleetManager`'s.

    write(run_dir, ScaleRequest(fleet="main", servers=8))          # asyncrl scale RUN_DIR --servers 8
    for req in take(run_dir): ...; answer(run_dir, req, outcome)    # in the controller
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

CONTROL_DIR = "control"
KEY_PREFIX = "asyncrl:control:"
MAX_REQUEST_BYTES = 4096


class ScaleRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Change the number of servers of one fleet. Exactly one of `servers` (the new size) and `delta`
    (+K / -K) is set; the result is clamped at 0 (a fleet of none serves nothing: refused)."""

    fleet: str = "main"
    servers: int | None = None
    delta: int | None = None
    id: str = ""
    time: float = 0.0

    def target(self, current: int) -> int:
        return self.servers if self.servers is not None else current + (self.delta or 0)


def new_request(fleet: str, servers: int | None = None, delta: int | None = None) -> ScaleRequest:
    if (servers is None) == (delta is None):
        raise ValueError("a scale request sets exactly one of servers and delta")
    if servers is not None and servers < 1:
        raise ValueError(f"--servers must be >= 1, got {servers}")
    return ScaleRequest(fleet=fleet, servers=servers, delta=delta, id=uuid.uuid4().hex[:12], time=time.time())


def _folder(run_dir: Path) -> Path:
    d = Path(run_dir) / CONTROL_DIR
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def write(run_dir: Path, req: ScaleRequest) -> None:
    """Drop `req` for the controller of the run in `run_dir` (atomically: it never reads half a request)."""
    d = _folder(run_dir)
    tmp = d / f".{req.id}.tmp"
    tmp.write_bytes(msgspec.json.encode(req))
    os.replace(tmp, d / f"{req.time:017.6f}-{req.id}.request")


def take(run_dir: Path) -> list[tuple[ScaleRequest | None, str]]:
    """The requests waiting in `run_dir`, oldest first, each removed as it is read: (request, '') or,
    for one that is not a valid request, (None, why) so the caller counts and logs it."""
    d = Path(run_dir) / CONTROL_DIR
    if not d.is_dir():
        return []
    out: list[tuple[ScaleRequest | None, str]] = []
    for path in sorted(d.glob("*.request")):
        try:
            data = path.read_bytes()[: MAX_REQUEST_BYTES + 1]
            path.unlink()
        except FileNotFoundError:  # taken by another reader
            continue
        out.append(_decode(data, path.name))
    return out


def _decode(data: bytes, where: str) -> tuple[ScaleRequest | None, str]:
    if len(data) > MAX_REQUEST_BYTES:
        return None, f"{where}: over {MAX_REQUEST_BYTES} bytes"
    try:
        req = msgspec.json.decode(data, type=ScaleRequest)
    except msgspec.DecodeError as e:
        return None, f"{where}: {e}"
    if (req.servers is None) == (req.delta is None):
        return None, f"{where}: sets both or neither of servers and delta"
    return req, ""


def answer(run_dir: Path, req: ScaleRequest, outcome: dict[str, Any]) -> None:
    """The controller's answer to `req` (what it did, or why it refused), where `asyncrl scale` looks."""
    d = _folder(run_dir)
    tmp = d / f".{req.id}.answer.tmp"
    tmp.write_text(json.dumps({"id": req.id, **outcome}))
    os.replace(tmp, d / f"{req.id}.json")


def read_answer(run_dir: Path, req_id: str) -> dict[str, Any] | None:
    path = Path(run_dir) / CONTROL_DIR / f"{req_id}.json"
    return json.loads(path.read_text()) if path.exists() else None


class RedisControl:
    """The same requests and answers for a run reached through Redis (`asyncrl scale --redis URL --name RUN`)."""

    def __init__(self, url: str, run_name: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.key = KEY_PREFIX + run_name

    def write(self, req: ScaleRequest) -> None:
        self.client.rpush(self.key, msgspec.json.encode(req))

    def take(self) -> list[tuple[ScaleRequest | None, str]]:
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.key, 0, 99)
        pipe.ltrim(self.key, 100, -1)
        items, _ = pipe.execute()
        return [_decode(bytes(item), self.key) for item in items]

    def answer(self, req: ScaleRequest, outcome: dict[str, Any]) -> None:
        self.client.set(f"{self.key}:answer:{req.id}", json.dumps({"id": req.id, **outcome}), ex=24 * 3600)

    def read_answer(self, req_id: str) -> dict[str, Any] | None:
        got = self.client.get(f"{self.key}:answer:{req_id}")
        return json.loads(got) if got else None

    def close(self) -> None:
        self.client.close()


def parse_servers(text: str) -> tuple[int | None, int | None]:
    """`--servers 8` -> (8, None); `+2` -> (None, 2); `-2` -> (None, -2)."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--servers: expected N, +K or -K, got {text!r}") from None
    return (None, n) if text.strip()[:1] in "+-" else (n, None)


def main(argv: list[str]) -> int:
    """`asyncrl scale [RUN_DIR | --redis URL --name RUN] --servers N|+K|-K [--fleet F] [--wait S]`: ask a
    running job to change the size of one fleet; prints the controller's answer (0) or why it refused (1),
    or that no answer came within `--wait` seconds (3: the run may not be running; 0 s: do not wait)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="asyncrl scale", description=main.__doc__)
    p.add_argument("run_dir", nargs="?", help="the run's directory (runs/<name>)")
    p.add_argument("--redis", help="a run whose queue is in Redis: its URL (with --name)")
    p.add_argument("--name", help="the run's name (its directory's name), with --redis")
    p.add_argument("--servers", required=True, help="the new number of servers N, or +K / -K")
    p.add_argument("--fleet", default="main", help="which fleet (default main)")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the answer (0: do not wait)")
    a = p.parse_args(argv)
    try:
        servers, delta = parse_servers(a.servers)
        req = new_request(a.fleet, servers=servers, delta=delta)
    except ValueError as e:
        p.error(str(e))
    if (a.run_dir is None) == (a.redis is None):
        p.error("give the run's directory or --redis URL --name RUN")
    remote = None
    if a.redis is not None:
        if not a.name:
            p.error("--redis needs --name (the run's name)")
        from asyncrl.redis_url import from_arg

        try:
            url = from_arg(a.redis)
        except ValueError as e:
            p.error(str(e))
        remote = RedisControl(url, a.name)
        remote.write(req)
        read = lambda: remote.read_answer(req.id)  # noqa: E731
    else:
        run_dir = Path(a.run_dir)
        if not (run_dir / "config.yaml").is_file():
            p.error(f"{run_dir} is not a run directory (no config.yaml)")
        try:
            state = json.loads((run_dir / "status.json").read_text()).get("state")
        except (OSError, ValueError):
            state = None
        if state in ("finished", "failed", "interrupted"):
            print(f"asyncrl scale: the run in {run_dir} is not running (its state: {state})", file=sys.stderr)
            return 1
        write(run_dir, req)
        read = lambda: read_answer(run_dir, req.id)  # noqa: E731
    print(f"asyncrl scale: asked fleet {req.fleet} for {a.servers} servers (request {req.id})", flush=True)
    deadline = time.time() + a.wait
    got = None
    while a.wait > 0 and time.time() < deadline:
        got = read()
        if got is not None:
            break
        time.sleep(0.25)
    if remote is not None:
        remote.close()
    if got is None:
        if a.wait > 0:
            print(f"asyncrl scale: no answer in {a.wait:g} s (is the run running?)", file=sys.stderr)
            return 3
        return 0
    if not got.get("ok"):
        print(f"asyncrl scale: refused: {got.get('error')}", file=sys.stderr)
        return 1
    print(f"asyncrl scale: fleet {got['fleet']}: {got['from']} -> {got['to']} servers", flush=True)
    return 0
