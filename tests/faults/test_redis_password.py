"""A Redis password is a secret (issue 44, item 6): never taken on a command line, never written or printed.

A real redis-server with `requirepass`; real `asyncrl train` / `config` / `status` processes. The URL
with its password comes from the environment (`'queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}'`, what
deploy/ does); on a command line it is refused without being repeated; after a run, nothing the run wrote
(config.yaml, status.json, summary.json, metrics, the MLflow store) nor anything printed holds it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from tests.integration.transfer_queue._redis import RedisServer

PASSWORD = "pw-9f31c07d5be2"


@pytest.fixture
def redis_url(tmp_path):
    server = RedisServer(str(tmp_path), appendonly=False, password=PASSWORD)
    yield server.url
    server.stop()


def _cli(tmp_path, *args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env={**os.environ, **(env or {})})


@pytest.mark.timeout(400)
def test_a_redis_password_is_taken_from_the_environment_only_and_written_nowhere(tmp_path, redis_url):
    run = ["train", "trainer.total_steps=2", "trainer.save_every=1", "trainer.eval_every=100", "queue.metadata=redis",
           f"logging.run_root={tmp_path}/runs", "logging.run_name=r", "logging.progress=false", "queue.run_id=pw"]
    refused = _cli(tmp_path, *run, f"queue.redis_url={redis_url}")
    assert refused.returncode != 0 and "queue.redis_url: a URL with a password is not taken on the command line" in refused.stderr
    assert PASSWORD not in refused.stdout + refused.stderr and not (tmp_path / "runs").exists()
    out = _cli(tmp_path, *run, "queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}", env={"ASYNCRL_REDIS_URL": redis_url})
    assert out.returncode == 0, out.stderr[-3000:]
    assert redis.Redis.from_url(redis_url).keys("tq:pw:*")  # the run used that Redis
    printed = out.stdout + out.stderr
    st = _cli(tmp_path, "status", "--redis", "env", "--name", "r", "--json", env={"ASYNCRL_REDIS_URL": redis_url})
    assert st.returncode == 0, st.stderr[-2000:]
    assert '"source": "redis://:<set>@127.0.0.1' in st.stdout
    printed += st.stdout + st.stderr
    no = _cli(tmp_path, "status", "--redis", redis_url, "--name", "r")
    assert no.returncode == 2 and "--redis env" in no.stderr
    printed += no.stdout + no.stderr
    recipe = tmp_path / "recipe.yaml"  # a 0600 recipe may hold it: `asyncrl config` shows it as <set>
    recipe.write_text(f"queue:\n  metadata: redis\n  redis_url: {redis_url}\n")
    recipe.chmod(0o600)
    cfg = _cli(tmp_path, "config", str(recipe))
    assert cfg.returncode == 0 and "redis://:<set>@127.0.0.1" in cfg.stdout, cfg.stderr[-2000:]
    printed += cfg.stdout + cfg.stderr
    recipe.chmod(0o644)
    loose = _cli(tmp_path, "config", str(recipe))
    assert loose.returncode != 0 and "other users can read" in loose.stderr
    printed += loose.stdout + loose.stderr
    assert PASSWORD not in printed
    written = [p for d in ("runs", "mlruns") for p in (tmp_path / d).rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and any(p.name == "mlflow.db" for p in written)
    assert not [p for p in written if PASSWORD.encode() in p.read_bytes()]
    key = (tmp_path / "runs" / "r" / "queue_record_key").read_bytes().strip()  # the records' MAC key: there alone
    assert len(key) == 64 and key not in printed.encode()
    assert [p.name for p in written if key in p.read_bytes()] == ["queue_record_key"]


def test_the_benchmarks_redis_asks_for_a_password_that_no_command_line_shows(tmp_path):
    """`asyncrl bench chaos`/`elastic`/`queue` start Redis with a random `requirepass` given on stdin: a client
    without it (another local user on 127.0.0.1) is refused, and the server's command line holds no password."""
    import redis

    from asyncrl.bench.redis_tools import redis_server

    proc, url = redis_server(str(tmp_path))
    try:
        password = redis.connection.parse_url(url)["password"]
        port = redis.connection.parse_url(url)["port"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert redis.Redis.from_url(url).ping()
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
        assert password.encode() not in cmdline and len(password) == 32
    finally:
        proc.kill()
        proc.wait()
