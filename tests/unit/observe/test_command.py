import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from asyncrl.observe import command, prometheus
from asyncrl.observe.command import judge, main
from asyncrl.observe.reporter import RedisStatus, StatusReporter
from asyncrl.observe.snapshot import SnapshotBuilder
from asyncrl.observe.view import render
from asyncrl.run_state import PipelineSource
from tests.unit.observe.fake import fake_pipeline

HOST = socket.gethostname()


def _snap(tmp_path, **over):
    snap = asyncio.run(SnapshotBuilder(PipelineSource(fake_pipeline(tmp_path))).build())
    snap.update(over)
    return snap


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_liveness_rules(tmp_path):
    now = time.time()
    live = _snap(tmp_path)
    assert judge(live, now)["status"] == "running" and judge(live, now)["alive"]
    dead = _snap(tmp_path, time=now - 30)
    dead["run"] = dict(dead["run"], pid=_gone_pid())
    j = judge(dead, now)
    assert j["status"] == "dead" and not j["alive"] and "no heartbeat for 30 s" in j["detail"]
    stalled = _snap(tmp_path, time=now - 60)  # our own pid: alive, but silent
    assert judge(stalled, now)["status"] == "stalled"
    remote = _snap(tmp_path, time=now - 60)
    remote["run"] = dict(remote["run"], host="elsewhere")
    assert judge(remote, now)["status"] == "dead"
    assert judge(_snap(tmp_path, state="finished"), now)["status"] == "finished"
    failed = judge(_snap(tmp_path, state="failed", error="RuntimeError: boom"), now)
    assert failed["status"] == "failed" and "boom" in failed["detail"] and not failed["alive"]
    assert set(judge(live, now)["component_age_s"]) >= {"status"}


def test_missing_run_is_a_message_not_a_traceback(tmp_path, capsys):
    assert main(["--root", str(tmp_path / "nothing")]) == 1
    assert "no run under" in capsys.readouterr().err
    assert main(["--run", str(tmp_path)]) == 1
    assert "has no status.json" in capsys.readouterr().err


def test_latest_local_run_and_starting_record(tmp_path, capsys):
    from asyncrl.run_dir import write_status

    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        write_status(tmp_path / name, state="starting", step=0)  # what `asyncrl train` writes first
        time.sleep(0.02)
    assert main(["--root", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["name"] == "new" and out["state"] == "starting" and out["liveness"]["alive"]
    assert main(["--root", str(tmp_path)]) == 0
    assert "no pipeline snapshot yet" in capsys.readouterr().out


def test_view_and_prometheus_show_the_same_figures(tmp_path):
    from rich.console import Console

    snap = _snap(tmp_path)
    snap["liveness"] = judge(snap)
    c = Console(width=130, record=True, file=open(os.devnull, "w"))
    c.print(render(snap))
    text = c.export_text()
    for word in ("ready", "leased", "complete_groups", "queue (at delivery)", "0:8", "server-1", "UNHEALTHY", "stale 4",
                 "parity (max/tol)", "2e-05/0.01", "response lengths by fate", "dropped_stale"):
        assert word in text, word
    prom = prometheus.render(snap)
    assert 'asyncrl_queue_depth{state="ready"} 8.0' in prom and 'asyncrl_staleness{staleness="1",view="queue"} 12.0' in prom  # prometheus_client sorts label names
    assert 'asyncrl_server_healthy{fleet="default",server="server-1"} 0.0' in prom
    server = prometheus.serve(0, lambda: snap)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5).read().decode()
        assert body == prom
    finally:
        server.shutdown()


def test_an_elastic_fleet_shows_its_size_over_time_and_its_changes(tmp_path):
    from rich.console import Console

    snap = _snap(tmp_path)
    snap["liveness"] = judge(snap)
    now = time.time()
    snap["fleets"]["default"].update(size=2, target=2, history=[[now - 90, 4], [now - 60, 8], [now - 5, 2]],
                                     events=[{"time": now - 61, "kind": "start", "server": "main-7",
                                              "startup": {"placement_s": 0.1, "queued_s": 0.0, "imports_s": 3.6, "build_s": 5.2, "total_s": 8.9}},
                                             {"time": now - 60, "kind": "join", "server": "main-7", "via": "peer"},
                                             {"time": now - 5, "kind": "preempt", "server": "main-3"}])
    c = Console(width=240, record=True, file=open(os.devnull, "w"))
    c.print(render(snap))
    text = c.export_text()
    for word in ("fleet size and changes", "2/2", "4 (90 s ago) -> 8 (60 s ago) -> 2 (5 s ago)", "join main-7 (peer)", "preempt main-3",
                 "start main-7 (up in 9.0 s: placement 0.1, queued 0.0, imports 3.6, build 5.2)"):
        assert word in text, word
    prom = prometheus.render(snap)
    assert 'asyncrl_fleet_size{fleet="default"} 2.0' in prom and 'asyncrl_fleet_target{fleet="default"} 2.0' in prom


@pytest.fixture
def redis_url(tmp_path):
    from tests.integration.transfer_queue._redis import RedisServer

    server = RedisServer(str(tmp_path), appendonly=False)
    yield server.url
    server.stop()


def test_redis_heartbeat_expires_into_dead(tmp_path, redis_url, capsys):
    (tmp_path / "cluster-run").mkdir()
    p = fake_pipeline(tmp_path / "cluster-run")
    p.cfg.queue.metadata, p.cfg.queue.redis_url = "redis", redis_url
    rep = StatusReporter(PipelineSource(p), ttl_s=1)
    asyncio.run(rep.tick())
    assert main(["--redis", redis_url, "--json"]) == 0  # no --name: the run that reported last
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["name"] == "cluster-run" and out["liveness"]["alive"] and out["queue"]["ready"] == 8
    time.sleep(2.2)  # the heartbeat key expires; the last-known snapshot stays
    assert main(["--redis", redis_url, "--name", "cluster-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["liveness"]["status"] == "dead" and out["source"].endswith(":last") and out["queue"]["ready"] == 8
    assert main(["--redis", redis_url, "--name", "nope"]) == 1
    assert "no run named 'nope'" in capsys.readouterr().err
    RedisStatus(redis_url, "x", 1).close()
