"""The three modes on the real tiny pipeline (torch engine, FSDP2 trainer, TransferQueue, CheckpointEngine)."""

import asyncio
import json
import time

import pytest

from asyncrl.config import load
from asyncrl.controller import Pipeline
from asyncrl.launch import build
from asyncrl.metrics import MetricsLogger


class SlowTrainer:
    """The real trainer, made deliberately slow so that rollouts run ahead of it."""

    def __init__(self, inner, delay_s):
        self.inner, self.delay_s = inner, delay_s

    def train(self, plan):
        time.sleep(self.delay_s)
        return self.inner.train(plan)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(tmp_path, overrides, slow_s=0.0):
    cfg = load(
        "configs/demo.yaml",
        [
            "trainer.prompts_per_step=4",
            "rollout.group_size=4",
            "data.eval_size=4",
            "trainer.eval_every=100",
            "trainer.save_every=0",
            "logging.mlflow=false",
            "logging.progress=false",
            f"model.cache_dir={tmp_path}/models",
            *overrides,
        ],
    )
    parts = build(cfg)
    if slow_s:
        parts.trainer = SlowTrainer(parts.trainer, slow_s)
    return _run_pipeline(cfg, lambda: parts, tmp_path / cfg.trainer.mode)


def _run_pipeline(cfg, make_parts, run_dir, in_order=None):
    """Run the pipeline on `make_parts()` (built inside the event loop); the summary and the
    per-step metrics after step 0. `in_order` overrides the mode's consumption order."""
    run_dir.mkdir()
    metrics = MetricsLogger(cfg.logging, run_dir, {})

    async def go():
        parts = make_parts()
        p = Pipeline(cfg, parts, run_dir, metrics)
        if in_order is not None:
            p.staleness.in_order = in_order
        try:
            return await p.run()
        finally:
            await parts.close()

    summary = asyncio.run(go())
    metrics.close()
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, [l for l in lines if l["step"] > 0]


@pytest.mark.timeout(300)
def test_fully_async_staleness_never_exceeds_eta_with_slow_trainer(tmp_path):
    summary, steps = _run(tmp_path, ["trainer.mode=fully_async", "trainer.max_staleness=2", "trainer.total_steps=6"], slow_s=0.6)
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    assert sum(hist.values()) == 6 * 4 * 4 == summary["trained_samples"]
    assert max(hist) <= 2, hist
    assert max(hist) == 2, f"the slow trainer should have let rollouts run ahead to the bound: {hist}"
    assert all(s["staleness/max"] <= 2 for s in steps)
    # rollouts were held back by admission, not by a lack of work: the trainer barely waited
    assert summary["rollout_idle_ratio"] > 0.2 and summary["trainer_idle_ratio"] < summary["rollout_idle_ratio"]


@pytest.mark.timeout(300)
def test_one_step_off_samples_are_exactly_one_version_old(tmp_path):
    summary, steps = _run(tmp_path, ["trainer.mode=one_step_off", "trainer.total_steps=5"], slow_s=0.3)
    assert steps[0]["staleness/max"] == 0  # the first batch has no older policy to come from
    for s in steps[1:]:
        assert s["staleness/mean"] == 1 and s["staleness/max"] == 1, s
    assert summary["drops"] == {}


@pytest.mark.timeout(300)
def test_sync_mode_trains_on_policy(tmp_path):
    summary, steps = _run(tmp_path, ["trainer.mode=sync", "trainer.total_steps=3"])
    assert all(s["staleness/max"] == 0 for s in steps)
    assert all(s["rollout/mixed_version"] == 0 for s in steps)
    assert summary["staleness_hist"] == {"0": 3 * 16}


def _cost_model_run(tmp_path, mode, steps, in_order=None, monkeypatch=None):
    """`mode` on the cost-model fleet of `asyncrl bench pipeline --quick` (long tail: groups
    finish out of start order); per-step metrics, the summary and, per trained batch, the versions
    its groups were admitted at (each group's admission recorded through `monkeypatch`)."""
    from asyncrl.bench.pipeline import QUICK, Load, build_parts
    from asyncrl.rollout.rollouter import Rollouter

    ld = Load(**QUICK)
    cfg = load(None, [
        f"trainer.mode={mode}", f"trainer.total_steps={steps}", f"trainer.prompts_per_step={ld.groups}",
        "trainer.eval_every=1000", "trainer.save_every=0", f"rollout.group_size={ld.group_size}",
        f"rollout.max_running_samples={ld.servers * ld.max_concurrency}", "queue.storage=local", "weights.backend=local",
        "logging.mlflow=false", "logging.progress=false",
    ])
    admitted: dict[str, int] = {}
    batches: list[list[int]] = []
    new_group = Rollouter._new_group

    def record_admission(self, prompt, version):
        g = new_group(self, prompt, version)
        admitted[g.group_id] = version
        return g

    monkeypatch.setattr(Rollouter, "_new_group", record_admission)

    def make_parts():
        parts = build_parts(ld, seed=0)
        plan = parts.make_plan

        def recording_plan(groups):
            batches.append(sorted(admitted[g[0].group_id] for g in groups))
            return plan(groups)

        parts.make_plan = recording_plan
        return parts

    summary, metrics = _run_pipeline(cfg, make_parts, tmp_path / f"{mode}-{in_order}", in_order)
    return summary, metrics, batches


@pytest.mark.timeout(120)
def test_one_step_off_is_exactly_one_version_old_when_groups_finish_out_of_order(tmp_path, monkeypatch):
    summary, steps, batches = _cost_model_run(tmp_path, "one_step_off", steps=8, monkeypatch=monkeypatch)
    assert len(batches) == 8 and batches[0] == [0] * 4
    # in order: step s trains the groups admitted at version s - 1, never a younger one
    for s, admitted in enumerate(batches[1:], start=1):
        assert admitted == [s - 1] * 4, (s, batches)
    # a sample's tokens are never older than its group's admission (staleness <= 1); one that waited
    # for a server slot until after the next publish has only newer tokens (staleness 0: seen under load)
    assert steps[0]["staleness/max"] == 0
    assert all(s["staleness/max"] == 1 for s in steps[1:]), steps
    assert summary["drops"] == {}
    # the load is out of order: taking the oldest *ready* groups trains some younger or drops some
    summary, steps, batches = _cost_model_run(tmp_path, "one_step_off", steps=8, in_order=False, monkeypatch=monkeypatch)
    assert summary["drops"] or any(a != [s - 1] * 4 for s, a in enumerate(batches[1:], start=1)), (summary, batches)
