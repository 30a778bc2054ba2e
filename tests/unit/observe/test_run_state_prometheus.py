"""The typed run state observers read, and the Prometheus text as prometheus_client writes and parses it."""

import asyncio
import dataclasses
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.observe import prometheus
from asyncrl.observe.command import judge
from asyncrl.observe.snapshot import SnapshotBuilder
from asyncrl.run_state import PipelineSource, RunState
from tests.unit.observe.fake import fake_pipeline


@pytest.mark.timeout(20)
def test_run_state_is_a_frozen_copy(tmp_path):
    p = fake_pipeline(tmp_path)
    source = PipelineSource(p)
    s = source.state()
    assert isinstance(s, RunState) and (s.step, s.version, s.accepted_groups) == (3, 3, 9)
    assert dict(s.staleness_hist) == {0: 8, 1: 12, 2: 4} and dict(s.drops) == {"stale": 1}
    assert (source.info.name, source.info.consumer, source.info.eta) == (tmp_path.name, "trainer", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.step = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.staleness_hist[0] = 99  # type: ignore[index]
    p.staleness_hist.update([5])
    p.step += 1
    assert 5 not in s.staleness_hist and s.step == 3  # a copy: it does not move with the pipeline
    assert source.state().step == 4 and source.state().staleness_hist[5] == 1


@pytest.mark.timeout(20)
def test_prometheus_label_values_are_escaped_and_parse_back(tmp_path):
    odd = 'a"b\\c\nd'
    p = fake_pipeline(tmp_path)
    p.parts.servers[1].name = odd
    snap = asyncio.run(SnapshotBuilder(PipelineSource(p)).build())
    snap["liveness"] = judge(snap)
    text = prometheus.render(snap)
    assert 'server="a\\"b\\\\c\\nd"' in text  # escaped on the wire: one line per sample
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    healthy = {s.labels["server"]: s.value for s in fams["asyncrl_server_healthy"].samples}
    assert healthy == {"server-0": 1.0, odd: 0.0}
    depth = {s.labels["state"]: s.value for s in fams["asyncrl_queue_depth"].samples}
    assert depth == {"ready": 8.0, "leased": 2.0, "waiting": 2.0, "acked": 24.0}
    assert fams["asyncrl_up"].samples[0].value == 1.0 and fams["asyncrl_trainer_step"].type == "gauge"
    server = prometheus.serve(0, lambda: snap)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5).read().decode()
        assert body == text
    finally:
        server.shutdown()
    assert prometheus.render({"liveness": {"alive": False}}).splitlines()[-1] == "asyncrl_up 0.0"
