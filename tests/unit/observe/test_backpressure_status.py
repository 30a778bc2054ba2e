"""`asyncrl status` carries the data plane's back-pressure: per server arena waits, the controller's undelivered frees."""

import asyncio
import json
import os

from rich.console import Console

from asyncrl.observe import prometheus
from asyncrl.observe.command import judge, main
from asyncrl.observe.reporter import StatusReporter
from asyncrl.observe.view import render
from asyncrl.run_state import PipelineSource
from tests.unit.observe.fake import fake_pipeline

UNDELIVERED = [{"endpoint": "tcp://10.0.0.7:41000", "producer": "shm producer pid 42", "frees": 17}]


def test_status_json_view_and_prometheus_carry_the_data_plane_backpressure(tmp_path, capsys):
    asyncio.run(StatusReporter(PipelineSource(fake_pipeline(tmp_path))).tick())
    assert main(["--run", str(tmp_path), "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["data_plane"] == {"arena_waits": 1, "arena_wait_s": 0.75, "arena_waiting": 0, "undelivered_frees": UNDELIVERED}
    fleet = snap["fleets"]["default"]
    ok, full = fleet["servers"]
    assert (ok["arena_waits"], ok["arena_wait_s"], ok["arena_waiting"]) == (0, 0.0, 0)
    assert (full["arena_waits"], full["arena_wait_s"], full["arena_waiting"]) == (4, 10.0, 1) and fleet["arena_waiting"] == 1

    c = Console(width=160, record=True, file=open(os.devnull, "w"))
    c.print(render(snap))
    text = c.export_text()
    for word in ("arena_waits", "4 (10.0 s) 1 WAITING", "data plane", "undelivered_frees",
                 "tcp://10.0.0.7:41000 (shm producer pid 42) 17"):
        assert word in text, word

    snap["liveness"] = judge(snap)
    prom = prometheus.render(snap)
    assert 'asyncrl_undelivered_frees{endpoint="tcp://10.0.0.7:41000",producer="shm producer pid 42"} 17.0' in prom
    assert 'asyncrl_server_arena_waits{fleet="default",server="server-1"} 4.0' in prom
    assert 'asyncrl_server_arena_waiting{fleet="default",server="server-1"} 1.0' in prom
    assert "asyncrl_data_plane_arena_wait_s 0.75" in prom
