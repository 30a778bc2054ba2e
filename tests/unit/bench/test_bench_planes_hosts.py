"""`asyncrl bench planes --hosts N`: its figures from what each part measured, and the run it asks for (no cluster)."""

from types import SimpleNamespace

from asyncrl.bench.planes import overrides
from asyncrl.bench.planes_hosts import LINK, assemble, pipeline_overrides, print_table


def _parts():
    pipe = {"steps": 5, "controller_tensor_bytes_per_step": 0.0, "controller_weight_bytes_per_publish": 0.0,
            "metadata_bytes_per_trajectory": 977.7, "publish_s_pipeline": 0.2, "publish_s_pipeline_each": [0.5, 0.2, 0.2],
            "sender_s_pipeline_each": [0.4, 0.1, 0.1], "gather_s_pipeline": 0.01, "controller_peak_rss_mb": 600.0,
            "rank_read_bytes_per_step": 1e5}
    before = {"publish_s_each": [0.9, 0.1, 0.1], "bytes": 38_000_000}
    after = {"publish_s_each": [0.9, 0.1, 0.3], "bytes": 38_000_000}
    across = {"records": 2000, "bytes": 16_384_000, "batch": 64, "read_s_each": [0.1], "records_per_s": 20000.0,
              "data_mb_per_s": 163.8}
    one = {"records": 2000, "bytes": 16_384_000, "batch": 64, "read_s_each": [0.08], "records_per_s": 25000.0,
           "data_mb_per_s": 204.8}
    return pipe, before, after, across, one


def test_the_figures_take_each_sides_publishes_after_their_first_and_say_which_targets_are_met(capsys):
    pipe, before, after, across, one = _parts()
    res = assemble(3, 9_500_000, pipe, before, after, across, one, {"ServerActor": [1, 2], "TrainerRankActor": [0, 1]},
                   [{"rx": 1, "tx": 2}] * 3, cluster_up_s=12.0)
    assert res["hosts"] == 3 and res["link"] == LINK and res["cluster_up_s"] == 12.0
    assert res["publish_s_bare_each"] == [0.1, 0.1, 0.1, 0.3]  # the first of each bare run pays first-touch faults
    assert res["publish_s_bare"] == 0.1 and res["publish_ratio"] == 0.5
    assert res["records_per_s_ratio"] == 0.8 and res["records_per_s_one_host"] == 25000.0
    t = res["targets"]
    assert t["controller_tensor_bytes_per_step"] == {"target": 0, "measured": 0.0, "met": True}
    assert t["metadata_bytes_per_trajectory"]["met"] and not t["publish_ratio"]["met"]
    print_table(res)
    out = capsys.readouterr().out
    assert "publish_ratio 0.8: measured 0.5 -> NOT met" in out and "records/s across hosts / one host" in out


def test_bytes_into_the_controller_miss_their_target_of_zero():
    pipe, before, after, across, one = _parts()
    pipe["controller_weight_bytes_per_publish"] = 38e6
    res = assemble(3, 1, pipe, before, after, across, one, {}, [])
    assert not res["targets"]["controller_weight_bytes_per_publish"]["met"]


def test_the_pipeline_runs_on_planes_that_cross_hosts_placed_as_the_layout_says(tmp_path, monkeypatch):
    from asyncrl.config import load

    hosts = SimpleNamespace(redis_url="redis://:pw@10.213.0.3:6379/0")
    monkeypatch.setenv("ASYNCRL_REDIS_URL", hosts.redis_url)  # what `HostsRun.env` gives the child: never its argv
    cfg = load(None, overrides(str(tmp_path), 64, str(tmp_path)) + ["ray.address=10.213.0.1:6379"] + pipeline_overrides(hosts, 5))
    assert (cfg.weights.backend, cfg.queue.storage, cfg.queue.metadata) == ("gloo", "zmq", "redis")
    assert cfg.weights.host == cfg.queue.bind_host == "auto" and cfg.weights.crosses_hosts and cfg.queue.crosses_hosts
    assert cfg.trainer.ray_resources == {"trainer_slot": 1} and cfg.rollout.ray_resources == {"server_slot": 1}
    assert cfg.trainer.total_steps == 5 and cfg.ray.address == "10.213.0.1:6379" and cfg.queue.redis_url == hosts.redis_url
    assert not any("pw" in kv for kv in pipeline_overrides(hosts, 5))


def test_without_namespaces_it_says_why_and_exits_2(monkeypatch, capsys):
    from asyncrl.bench import planes_hosts

    monkeypatch.setattr(planes_hosts, "available", lambda: "simulated hosts need root (network, mount and pid namespaces)")
    assert planes_hosts.main(3, True, False, lambda cache: ("", 0)) == 2
    assert "need root" in capsys.readouterr().err
