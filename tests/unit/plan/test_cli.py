"""`asyncrl plan` prints the keys the issue names; the public profile stays calibrated to its source."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main
from asyncrl.plan.costs import Reference, load_profile
from asyncrl.plan.search import calibrate_token_cost, colocated_sync


def small_profile(tmp_path) -> str:
    import yaml

    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({
        "name": "small", "gpus_per_server": 1, "max_concurrency": 8, "token_cost_s": 0.01, "trainer_tokens_per_s_per_gpu": 2000.0,
        "lengths": {"short_tokens": 50}, "groups": 8, "group_size": 4, "base_gpus": 16, "eta": 2, "split_step": 4,
        "reference": {"gpus": 16, "rollout_gpus": 8, "trainer_gpus": 8, "speedup_vs_sync": 2.0, "source": "made up for the test"},
    }))
    return str(path)


@pytest.mark.timeout(60)
def test_projection_json_has_the_rows_reference_and_plot(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["plan", "--gpus", "16,32", "--profile", small_profile(tmp_path), "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["projection"]
    assert [r["gpus"] for r in rows] == [16, 32]
    for r in rows:
        assert {"gpus", "rollout_gpus", "trainer_gpus", "tokens_per_s", "speedup_vs_sync", "staleness_mean"} <= set(r)
        assert r["rollout_gpus"] + r["trainer_gpus"] == r["gpus"] and r["tokens_per_s"] > 0 and r["speedup_vs_sync"] > 1
        assert {"publish_fanout", "all_reduce", "sync_all_reduce", "straggler"} <= set(r["terms"]) and "weak_scaling_efficiency" in r
    assert out["reference"]["speedup_vs_sync"] == 2.0 and out["reference"]["predicted_at_reference_split"]["speedup_vs_sync"] > 0
    assert set(out["reference"]["rel_error"]) == {"speedup_vs_sync"}  # the made-up reference publishes no async step
    assert out["limits"]["from_gpus"] == 16 and "all_reduce_gpus" in out["limits"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_split_with_the_batch_of_more_gpus_is_strong_scaling(tmp_path, capsys):
    """`--batch-gpus 16` on an 8-GPU split: the batch of the 16-GPU reference, beside colocated sync
    on the same 8 GPUs with that batch (a run on fewer GPUs, as verl's 16:16 and 32:32 rows)."""
    path = small_profile(tmp_path)
    main(["plan", "--profile", path, "--gpus", "16", "--split", "4:4", "--batch-gpus", "16", "--json"])
    strong = json.loads(capsys.readouterr().out)["split"]
    main(["plan", "--profile", path, "--gpus", "16", "--split", "4:4", "--json"])
    weak = json.loads(capsys.readouterr().out)["split"]
    assert strong["batch_gpus"] == 16 and weak["batch_gpus"] == 8
    per_version = lambda r: r["trained_tokens_per_s"] * r["version_s"]
    assert per_version(strong) == pytest.approx(2 * per_version(weak), rel=0.1)  # twice the batch per version
    assert strong["version_s"] > weak["version_s"] and strong["sync_step_s"] > weak["sync_step_s"]
    with pytest.raises(SystemExit):
        main(["plan", "--profile", path, "--split", "4-4"])
    assert "--split" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_unknown_profile_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--profile", "no-such-profile", "--gpus", "16"])
    assert "--profile" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_public_profile_loads_and_its_derived_numbers_follow_from_its_reference():
    """Each `derived` field of the public profile is what its comment says it is, from the
    reference's published components (the async step and the speedup are not among them)."""
    prof = load_profile("qwen2.5-math-7b-h800")
    ref = prof.reference
    assert isinstance(ref, Reference) and ref.speedup_vs_sync == 2.35 and "verl" in ref.source
    assert colocated_sync(prof, 128)["step_s"] == pytest.approx(ref.sync_step_s, rel=0.01)
    k, tokens = prof.publish_every, prof.groups * prof.group_size * prof.lengths.mean
    update = k * (tokens / (prof.trainer_tokens_per_s_per_gpu * ref.trainer_gpus) + prof.scaling.collective_s(ref.trainer_gpus))
    assert update == pytest.approx(ref.actor_update_s, rel=1e-3)  # one version's updates on the split's 64 trainer GPUs
    colocated = k * (tokens / (prof.colocated_trainer_tokens_per_s_per_gpu * ref.gpus) + prof.scaling.collective_s(ref.gpus))
    assert colocated == pytest.approx(ref.sync_actor_update_s + ref.sync_old_log_prob_s, rel=1e-3)
    rest = ref.sync_step_s - ref.sync_gen_s - ref.sync_old_log_prob_s - ref.sync_actor_update_s
    assert prof.publish_s + prof.colocated_switch_s == pytest.approx(rest, abs=0.01)
    base, slope = calibrate_token_cost(prof, ref.gpus, ref.sync_step_s)  # the curve's level: sync generates in sync_gen_s
    assert base == pytest.approx(prof.token_cost_s, rel=0.01) and slope == pytest.approx(prof.token_cost_slope_s, rel=0.01)
    assert slope / base == pytest.approx(54e-6 / 4.0e-3, rel=0.01)  # the roofline's shape the YAML derives
