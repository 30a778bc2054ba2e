"""`asyncrl plan` prints the keys the issue names; the public profile stays calibrated to its source."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main
from asyncrl.plan.costs import Profile, Reference, load_profile
from asyncrl.plan.search import colocated_sync
from asyncrl.rollout.cost_model import LongTail


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
    assert out["reference"]["speedup_vs_sync"] == 2.0 and out["reference"]["predicted_at_reference_split"]["speedup_vs_sync"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(30)
def test_unknown_profile_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--profile", "no-such-profile", "--gpus", "16"])
    assert "--profile" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_public_profile_loads_and_matches_its_published_sync_step():
    prof = load_profile("qwen2.5-math-7b-h800")
    assert isinstance(prof.reference, Reference) and prof.reference.speedup_vs_sync == 2.35 and "verl" in prof.reference.source
    assert colocated_sync(prof, 128)["step_s"] == pytest.approx(prof.reference.sync_step_s, rel=0.05)
    tokens = prof.groups * prof.group_size * prof.lengths.mean
    train_s = tokens / (prof.trainer_tokens_per_s_per_gpu * prof.reference.trainer_gpus) + prof.scaling.collective_s(prof.reference.trainer_gpus)
    assert train_s == pytest.approx(prof.reference.actor_update_s, rel=0.01)
