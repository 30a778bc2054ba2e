import asyncio
import json

import msgspec

from asyncrl.observe.command import main
from asyncrl.observe.reporter import FINAL_FILE, StatusReporter
from asyncrl.observe.snapshot import SCHEMA_VERSION, SnapshotBuilder, hist
from asyncrl.run_state import PipelineSource
from tests.unit.observe.fake import fake_pipeline


def test_snapshot_figures_come_from_the_queue_and_pipeline(tmp_path):
    p = fake_pipeline(tmp_path)
    snap = asyncio.run(SnapshotBuilder(PipelineSource(p)).build())
    q = snap["queue"]
    assert snap["schema_version"] == SCHEMA_VERSION and snap["state"] == "running"
    assert (q["ready"], q["leased"], q["waiting"], q["acked"], q["capacity"], q["complete_groups"]) == (8, 2, 2, 24, 64, 3)
    assert q["stats"] == msgspec.to_builtins(p.queue.client.stats_value, str_keys=True) and q["drops"] == {"stale": 4}
    assert snap["staleness"]["queue"] == {"0": 8, "1": 12, "2": 4}  # sorted numerically, string keys
    assert snap["staleness"]["trained"] == {"0": 8, "1": 12, "2": 4} and snap["drops"] == {"stale": 1}
    servers = snap["fleets"]["default"]["servers"]
    assert [s["version"] for s in servers] == [3, 2] and [s["healthy"] for s in servers] == [True, False]
    assert snap["fleets"]["default"]["in_flight"] == 6
    assert (snap["trainer"]["step"], snap["trainer"]["version"], snap["weights"]["last_publish_s"]) == (3, 3, 0.25)
    assert snap["weights"]["evicted"] == {"server-1": "timeout"}
    assert snap["lengths"]["dropped_stale"] == {"count": 1, "mean": 30.0, "p50": 30, "p90": 30, "max": 30}  # a reason, as the fleet manager records it
    assert abs(snap["weights"]["parity_max_abs"] - 2e-5) < 1e-9 and snap["weights"]["parity_tol"] == 0.01
    assert 0 < snap["rates"]["produced_per_s"] and 0 < snap["trainer"]["idle_ratio"] < 1
    json.dumps(snap)  # plain JSON, no custom types


def test_last_batch_is_the_growth_of_the_trained_histogram(tmp_path):
    p = fake_pipeline(tmp_path)
    b = SnapshotBuilder(PipelineSource(p))
    asyncio.run(b.build())
    p.staleness_hist.update([2, 2, 1])
    p.step += 1
    snap = asyncio.run(b.build())
    assert snap["staleness"]["last_batch"] == {"1": 1, "2": 2}
    assert snap["heartbeats"]["trainer"] is not None and snap["heartbeats"]["rollout"] is None
    assert hist({3: 0, 1: 2}) == {"1": 2}


def test_reporter_final_state_survives_the_lifecycle_record(tmp_path, capsys):
    from asyncrl.run_dir import write_status

    p = fake_pipeline(tmp_path)
    rep = StatusReporter(PipelineSource(p))

    async def go():
        await rep.tick()
        await rep.final()

    asyncio.run(go())
    assert json.loads((tmp_path / FINAL_FILE).read_text())["state"] == "finished"
    write_status(tmp_path, state="finished", step=3)  # what `asyncrl train` writes last
    assert main(["--run", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "finished" and out["liveness"]["status"] == "finished" and not out["liveness"]["alive"]
    assert out["queue"]["ready"] == 8  # the last-known figures are kept


def test_final_snapshot_of_a_failing_run_says_failed(tmp_path):
    p = fake_pipeline(tmp_path)
    rep = StatusReporter(PipelineSource(p))

    async def go():
        try:
            raise RuntimeError("trainer died")
        finally:
            await rep.final()

    try:
        asyncio.run(go())
    except RuntimeError:
        pass
    snap = json.loads((tmp_path / "status.json").read_text())
    assert snap["state"] == "failed" and "trainer died" in snap["error"]


MISMATCH = {"step": 3, "logprob_gap_mean": 0.0123, "logprob_gap_max": 0.41, "k3_seq_mean": 0.003, "k3_seq_max": 0.02,
            "token_masked_share": 0.012, "token_truncated_share": 0.0, "seq_masked_share": 0.034, "ess": 0.97}


def _text(snap: dict) -> str:
    import os

    from rich.console import Console

    from asyncrl.observe.view import render

    c = Console(width=200, record=True, file=open(os.devnull, "w"))
    c.print(render(snap))
    return c.export_text()


def test_mismatch_block_decodes_and_renders_its_line_and_a_snapshot_without_it_still_decodes(tmp_path):
    import dataclasses
    from collections.abc import Mapping

    from asyncrl.observe.schema import check
    from asyncrl.run_state import RunState

    @dataclasses.dataclass(frozen=True)
    class WithMismatch(RunState):  # the latest step's `mismatch/*`, as the run state hands them to the builder
        mismatch: Mapping[str, float] = dataclasses.field(default_factory=dict)

    class Source(PipelineSource):
        def state(self):
            s = super().state()
            fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
            return WithMismatch(**{**fields, "mismatch": {**MISMATCH, "ess": 0.9700000001}})

    snap = json.loads(json.dumps(asyncio.run(SnapshotBuilder(Source(fake_pipeline(tmp_path))).build())))
    assert snap["mismatch"] == MISMATCH  # to 6 significant digits
    typed = check(snap, "status.json")
    assert typed["mismatch"] == MISMATCH
    line = next(l for l in _text(typed).splitlines() if l.startswith("mismatch"))
    assert line == ("mismatch (step 3) logprob_gap mean 0.0123 max 0.41 · k3_seq mean 0.003 max 0.02 · "
                    "masked 1.2% tokens 3.4% seqs · truncated 0% tokens · ess 0.97")
    from asyncrl.observe import prometheus

    alive = {"liveness": {"alive": True, "component_age_s": {}}}  # what the watcher adds before it serves a snapshot
    prom = prometheus.render({**typed, **alive})  # `asyncrl status --watch --prometheus`: a label per figure
    assert 'asyncrl_mismatch{figure="ess"} 0.97' in prom and "asyncrl_mismatch_step 3.0" in prom

    old = asyncio.run(SnapshotBuilder(PipelineSource(fake_pipeline(tmp_path))).build())  # no step reported: no block
    assert "mismatch" not in old and "mismatch" not in check(json.loads(json.dumps(old)), "status.json")
    assert not any(l.startswith("mismatch") for l in _text(check(old, "status.json")).splitlines())
    assert "asyncrl_mismatch" not in prometheus.render({**check(old, "status.json"), **alive})
    partial = check({**old, "mismatch": {"step": 1, "ess": 1.0}}, "status.json")  # a figure that was not finite is absent
    assert "logprob_gap mean - max - ·" in next(l for l in _text(partial).splitlines() if l.startswith("mismatch"))
