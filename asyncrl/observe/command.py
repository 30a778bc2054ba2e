"""`asyncrl status`: find a run, read its latest snapshot, judge whether it is alive, show it.

    asyncrl status                          the most recent run under runs/ (--root DIR)
    asyncrl status --run runs/fully_async-20261129-170000
    asyncrl status --redis redis://host:6379/0 [--name RUN]   a cluster run, from any host
    asyncrl status --redis env [--name RUN]   the same, the URL (with its password) from ASYNCRL_REDIS_URL
    asyncrl status --json                   one snapshot, schema in docs/status.md
    asyncrl status --watch [--interval 1] [--prometheus 9464 [--prometheus-host 127.0.0.1]]
                                            also serve the figures as Prometheus text on HOST:PORT/metrics
    asyncrl status --gc [--shm-dir /dev/shm] [--keep-s 86400]
                                            remove what this user's runs that are gone left in shared
                                            memory (asyncrl/shm_gc.py); every view shows it (`shm_dead`)

Job: locate the snapshot (a run directory's `status.json`, or Redis keys written by
`StatusReporter`), check it against its typed form (`schema.py`: a snapshot of another shape is one
line naming the wrong field, exit code 1), add `liveness` (alive, or dead / stalled / finished / failed / interrupted, with
the age of its last heartbeat; a failed or interrupted run's recorded line) and `source`, then print it. Boundary: reads only; never
touches the run. A missing run or a malformed snapshot is the one error translated into a message (exit code 1);
a dead run is not an error, it is a status. `--gc` is the one verb that removes something: files
of this user's runs that are gone, never a live run's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.observe.reporter import FINAL_FILE, KEY_PREFIX, RUNS_KEY, status_key
from asyncrl.observe.schema import LifecycleRecord, Snapshot, check
from asyncrl.observe.snapshot import MalformedSnapshot, RunNotFound, lifecycle_snapshot
from asyncrl.redis_url import from_arg, redact_url
from asyncrl.shm_gc import KEEP_S, collect
from plane_common.liveness import pid_alive
from plane_common.net import LOOPBACK, resolve

STALL_INTERVALS = 5
"""A live process whose heartbeat is older than this many reporting intervals is `stalled`
(remote: `dead`, since its pid cannot be checked)."""
MIN_STALL_S = 10.0


def latest_run(root: Path) -> Path:
    runs = [p.parent for p in root.glob("*/status.json")]
    if not runs:
        raise RunNotFound(f"no run under {str(root)!r} (no <run>/status.json); pass --run DIR, --root DIR or --redis URL")
    return max(runs, key=lambda d: (d / "status.json").stat().st_mtime)


MAX_DEPTH = 16
"""Nesting a snapshot may have (the schema's is 5): deeper is malformed, never a RecursionError."""
MAX_SNAPSHOT_BYTES = 16 << 20

_CONTROL = dict.fromkeys([*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)])
_CONTROL.update({ord("\n"): " ", ord("\t"): " "})


def decode(raw: bytes | str, source: str) -> dict[str, Any]:
    """The JSON snapshot `raw` with every string (keys too) stripped of control characters (escape
    sequences: a title change, a clipboard write, a clear screen; newlines and tabs become spaces),
    as a dict nested at most `MAX_DEPTH` deep; anything else is `MalformedSnapshot`. Its fields'
    types are `schema.check`'s to judge."""
    if len(raw) > MAX_SNAPSHOT_BYTES:
        raise MalformedSnapshot(f"{source}: snapshot of {len(raw)} bytes, over {MAX_SNAPSHOT_BYTES}")
    try:
        snap = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise MalformedSnapshot(f"{source}: not a JSON snapshot ({type(e).__name__})") from None
    if not isinstance(snap, dict):
        raise MalformedSnapshot(f"{source}: a snapshot is a JSON object, not {type(snap).__name__}")
    return _clean(snap, 0, source)


def plain(text: str) -> str:
    """`text` (a path, a Redis key: a run directory's name is whoever made it) without control characters."""
    return text.translate(_CONTROL)


def _clean(v: Any, depth: int, source: str) -> Any:
    if depth > MAX_DEPTH:
        raise MalformedSnapshot(f"{source}: snapshot nested over {MAX_DEPTH} deep")
    if isinstance(v, str):
        return v.translate(_CONTROL)
    if isinstance(v, dict):
        return {str(k).translate(_CONTROL): _clean(x, depth + 1, source) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x, depth + 1, source) for x in v]
    return v


def read_local(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "status.json"
    if not path.is_file():
        raise RunNotFound(f"{str(run_dir)!r} has no status.json (not a run directory, or the run never started)")
    shown = plain(str(path))
    record = decode(path.read_bytes(), shown)
    if "schema_version" not in record:  # `asyncrl train`'s lifecycle record: starting / failed / finished
        final = run_dir / FINAL_FILE
        last = check(decode(final.read_bytes(), plain(str(final))), plain(str(final)), Snapshot) if final.is_file() else None
        record = lifecycle_snapshot(check(record, shown, LifecycleRecord), plain(str(run_dir.resolve())), last)
    record = check(record, shown)
    record["source"] = plain(str(path.resolve()))
    return record


def read_redis(url: str, name: str | None) -> dict[str, Any]:
    import redis

    shown = redact_url(url)  # what may be printed of it

    client = redis.Redis.from_url(url)
    try:
        if not name:
            newest = client.zrevrange(RUNS_KEY, 0, 0)
            if not newest:
                raise RunNotFound(f"no run has reported to {shown} ({RUNS_KEY} is empty)")
            name = newest[0].decode()
        pipe = client.pipeline(transaction=True)
        pipe.get(status_key(name))
        pipe.pttl(status_key(name))
        live, ttl_ms = pipe.execute()
        raw = live if live is not None else client.get(status_key(name) + ":last")
    finally:
        client.close()
    if raw is None:
        raise RunNotFound(f"no run named {name!r} in {shown} (no {KEY_PREFIX}{name}: never started, or reported over a week ago)")
    where = plain(f"{shown} {status_key(name)}")
    snap = check(decode(raw, where), where)
    snap["source"] = where + ("" if live is not None else ":last")
    snap["heartbeat_expired"] = live is None
    full = snap.pop("heartbeat_ttl_s", None)
    if live is not None and full and ttl_ms and ttl_ms > 0 and snap.get("time") is not None:
        # the heartbeat's age by Redis' clock (the key's TTL has run down that long), so the writer's and this
        # host's clocks need not agree: the difference is this host's offset from the writer's clock
        age = max(full - ttl_ms / 1000.0, 0.0)
        snap["clock_offset_s"] = round(time.time() - snap["time"] - age, 3)
    return snap


def judge(snap: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """`liveness` of a snapshot: status (state, or dead / stalled), alive, detail, heartbeat ages. Ages
    are on the writer's clock where the reader knows its offset from it (`clock_offset_s`, a snapshot read
    from Redis): a host whose clock is off does not see a live run as dead."""
    now = (time.time() if now is None else now) - snap.get("clock_offset_s", 0.0)
    state = snap.get("state", "running")
    beat = snap.get("time")
    age = None if beat is None else max(now - beat, 0.0)
    ages = {k: round(now - t, 1) for k, t in (snap.get("heartbeats") or {}).items() if t is not None}
    interval = snap.get("interval_s") or 1.0
    limit = max(STALL_INTERVALS * interval, MIN_STALL_S)
    run = snap.get("run") or {}
    pid, host = run.get("pid"), run.get("host")
    status, alive, detail = state, state in ("starting", "running"), state
    if state == "failed":
        detail = f"failed: {snap.get('error') or 'unknown error'}"
    elif state == "interrupted":  # Ctrl-C: `asyncrl train` recorded the step and the command that resumes the run
        detail = snap.get("error") or f"interrupted at step {(snap.get('trainer') or {}).get('step', '?')}"
    elif state == "finished":
        detail = f"finished {age:.0f} s ago" if age is not None else "finished"
    elif pid is not None and host == socket.gethostname() and not pid_alive(pid):
        status, alive = "dead", False
        detail = f"dead (no heartbeat for {age:.0f} s; process {pid} is gone; last state {state})"
    elif snap.get("heartbeat_expired") or (age is not None and age > limit and host != socket.gethostname()):
        status, alive = "dead", False
        detail = f"dead (no heartbeat for {age:.0f} s; last state {state})"
    elif age is not None and age > limit and state == "running":
        status = "stalled"
        detail = f"stalled (no heartbeat for {age:.0f} s; process {pid} still exists)"
    return {"status": status, "alive": alive, "detail": detail,
            "heartbeat_age_s": None if age is None else round(age, 1), "component_age_s": ages}


def read(args: argparse.Namespace) -> dict[str, Any]:
    if args.redis:
        snap = read_redis(from_arg(args.redis), args.name)
    else:
        snap = read_local(Path(args.run) if args.run else latest_run(Path(args.root)))
    snap["liveness"] = judge(snap)  # of a checked snapshot (`schema.check`): its fields have their types
    snap["shm_dead"] = collect(args.shm_dir, args.keep_s, remove=False).summary()  # this host's /dev/shm
    return snap


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs", help="folder of local runs (logging.run_root); the most recent is shown")
    p.add_argument("--run", metavar="DIR", help="a run directory")
    p.add_argument("--redis", metavar="URL", help="read a cluster run from Redis (queue.redis_url of the run): a URL without "
                   "a password, or `env` for ASYNCRL_REDIS_URL (a password never goes on a command line)")
    p.add_argument("--name", metavar="RUN", help="with --redis: the run name (default: the one that reported last)")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON (docs/status.md)")
    p.add_argument("--watch", action="store_true", help="refresh a live view until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--prometheus", type=int, metavar="PORT", help="with --watch: serve the figures as Prometheus text on "
                   "HOST:PORT/metrics (HOST: --prometheus-host)")
    p.add_argument("--prometheus-host", metavar="HOST",
                   help="with --prometheus: the address it binds (default 127.0.0.1: this host only); in a pod, the pod's "
                   "address (`auto`: the default route's; also `iface:NAME` or a CIDR, as queue.bind_host); never a wildcard")
    p.add_argument("--gc", action="store_true", help="remove what this user's runs that are gone left in --shm-dir, then print what went")
    p.add_argument("--shm-dir", default="/dev/shm", help="the runs' queue.shm_dir (what `shm_dead` and --gc look at)")
    p.add_argument("--keep-s", type=float, default=KEEP_S, help="queue.shm_keep_s: how long files a resume may read are kept")
    args = p.parse_args(argv)
    if args.redis:
        try:
            from_arg(args.redis)
        except ValueError as e:
            p.error(str(e))
    if args.gc and args.watch:
        p.error("--gc and --watch exclude each other")
    if args.json and args.watch:
        p.error("--json and --watch exclude each other")
    if args.prometheus is not None and not args.watch:
        p.error("--prometheus needs --watch")
    if args.prometheus_host is not None and args.prometheus is None:
        p.error("--prometheus-host needs --prometheus")
    try:  # resolved here, on the host that binds it: a spec this host has no address for is a usage error
        args.prometheus_host = resolve(args.prometheus_host or LOOPBACK, "--prometheus-host")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.gc:
        report = collect(args.shm_dir, args.keep_s)
        summary = report.summary()
        if args.json:
            print(json.dumps({"shm_gc": summary}, indent=1), flush=True)
        else:
            print(f"asyncrl status --gc: {report.line() or f'nothing of a run that is gone in {args.shm_dir}'}", flush=True)
            for run_id, why in summary["kept"].items():
                print(f"  kept {run_id}: {why}", flush=True)
        return 0
    try:
        snap = read(args)
    except RunNotFound as e:
        print(f"asyncrl status: {plain(str(e))}", file=sys.stderr)
        return 1
    if args.json:
        try:
            print(json.dumps(snap, indent=1), flush=True)
        except BrokenPipeError:  # `asyncrl status --json | head`: the reader left, nothing to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    from asyncrl.observe.view import show, watch

    if args.watch:
        return watch(lambda: read(args), interval_s=args.interval, prometheus_port=args.prometheus,
                     prometheus_host=args.prometheus_host)
    try:
        show(snap)
    except MalformedSnapshot as e:
        print(f"asyncrl status: {plain(str(e))}", file=sys.stderr)
        return 1
    return 0
