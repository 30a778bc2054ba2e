"""A Ray head on 127.0.0.1 that outlives the processes that use it: what a cluster is to a controller.

`ray_head` starts one with `deploy/ray/start_cluster.sh head` (its own process group, token
authentication, a short temp dir: Ray's socket paths must stay under 107 bytes) and stops exactly
that node when the block ends (`start_cluster.sh stop`, never `ray stop`, which would end every Ray
on the host). A controller killed while it runs leaves the cluster up, as on a real cluster: what
`ray.detached` needs (`asyncrl bench chaos`, `tests/integration/test_resume_reattach.py`).

    with ray_head(num_cpus=5) as (address, env, leader):
        subprocess.run([..., "asyncrl", "train", ..., "ray.enabled=true", f"ray.address={address}"], env=env)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "ray" / "start_cluster.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_head(num_cpus: int, timeout_s: float = 120.0) -> Iterator[tuple[str, dict[str, str], int]]:
    """(address, environment for its drivers: the token, the run secret, PATH with this venv; the pid
    of the node's process group leader: its descendants are the cluster's processes, actors included)."""
    bin_dir = Path(sys.executable).parent
    ray = bin_dir / "ray" if (bin_dir / "ray").exists() else Path(shutil.which("ray") or "ray")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", RAY=str(ray), PYTHON=sys.executable,
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), ASYNCRL_SECRET=secrets.token_hex(16))
    short = Path(tempfile.mkdtemp(prefix="ar-", dir="/tmp"))
    pid_file = short / "head.pid"
    port = free_port()
    address = f"127.0.0.1:{port}"
    run = lambda *a: subprocess.run([str(SCRIPT), *a], env=env, cwd=REPO, timeout=timeout_s, check=True,  # noqa: E731
                                    stdout=subprocess.DEVNULL)
    try:
        run("head", "--ip", "127.0.0.1", "--port", str(port), "--num-cpus", str(num_cpus), "--temp-dir", str(short / "ray"),
            "--pid-file", str(pid_file), "--", "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()))
        run("run", "--address", address, "--wait-nodes", "1", "--wait-s", str(int(timeout_s)), "--", "true")
        yield address, env, int(pid_file.read_text())
    finally:
        subprocess.run([str(SCRIPT), "stop", "--pid-file", str(pid_file)], env=env, timeout=60, check=False)
        keep = os.environ.get("ASYNCRL_KEEP_RAY_LOGS")  # a folder: the node's logs are copied there before they go
        if keep:
            shutil.copytree(short / "ray", Path(keep) / short.name, dirs_exist_ok=True, ignore_dangling_symlinks=True,
                            ignore=shutil.ignore_patterns("sockets", "*.sock"))
        shutil.rmtree(short, ignore_errors=True)
