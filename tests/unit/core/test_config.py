import pytest

from asyncrl.config import Config, ConfigError, document, dump_resolved, load


def test_defaults_load_and_roundtrip(tmp_path):
    cfg = load()
    assert isinstance(cfg, Config) and cfg.trainer.mode in ("sync", "one_step_off", "fully_async")
    dump_resolved(cfg, tmp_path / "config.yaml")
    again = load(tmp_path / "config.yaml")
    assert again == cfg


def test_yaml_and_overrides_merge(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("trainer:\n  lr: 0.5\n  total_steps: 3\nrollout:\n  group_size: 4\n")
    cfg = load(p, ["trainer.total_steps=7", "algorithm.advantage=rloo"])
    assert (cfg.trainer.lr, cfg.trainer.total_steps, cfg.rollout.group_size, cfg.algorithm.advantage) == (0.5, 7, 4, "rloo")


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lr=abc", "trainer.lr"),
        ("trainer.nonexistent=1", "trainer.nonexistent"),
        ("trainer.mode=sideways", "trainer.mode"),
        ("trainer.lr=-1", "trainer.lr"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.backend=tensorrt", "rollout.backend"),
        ("algorithm.loss_agg=median", "algorithm.loss_agg"),
        ("algorithm.loss_args.clip_ratio_c=0.5", "algorithm.loss_args.clip_ratio_c"),
        ("algorithm.loss_args.no_such_setting=1", "algorithm.loss_args.no_such_setting"),
        ("algorithm.clip_ratio_c=0.5", "algorithm.clip_ratio_c"),
        ("model.dtype=int3", "model.dtype"),
        ("model.path=/does/not/exist", "model.path"),
        ("data.task=jsonl", "data.train_path"),
        ("nosuchsection.x=1", "nosuchsection"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load(None, [override])
    assert key in str(e.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ray.enabled=true", "queue.storage=local"], "queue.storage"),  # other processes must reach the tensors
        (["ray.enabled=true", "weights.backend=local"], "weights.backend"),  # sender and receivers in other processes
        (["trainer.num_ranks=2"], "trainer.num_ranks"),  # ranks are Ray actors (or torchrun)
        (["trainer.gpus_per_rank=0"], "trainer.gpus_per_rank"),
        (["rollout.gpus_per_worker=2"], "rollout.gpus_per_worker"),
        (["weights.backend=cuda_ipc"], "weights.device"),
    ],
)
def test_distributed_layout_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load(None, overrides)
    assert key in str(e.value)


def test_cuda_where_no_gpu_can_be_had_names_the_key(monkeypatch):
    import ray
    import torch

    from asyncrl.launch import check_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer.device: cuda, but this machine has no usable CUDA GPU"):
        check_gpus(load(None, ["trainer.device=cuda"]))
    check_gpus(load(None, ["trainer.device=auto"]))  # auto falls back to the CPU
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"^trainer.device: cuda needs 2 GPUs .* the Ray cluster has 1"):
        check_gpus(load(None, ["ray.enabled=true", "trainer.device=cuda", "trainer.num_ranks=2"]))
    with pytest.raises(ConfigError, match=r"^rollout.gpu_bundles"):
        check_gpus(load(None, ["ray.enabled=true", "trainer.device=cuda", "rollout.gpu_bundles=true"]))
    check_gpus(load(None, ["ray.enabled=true", "trainer.device=cuda", "trainer.gpus_per_rank=0.5",
                           "rollout.gpu_bundles=true", "rollout.gpus_per_worker=0.5"]))  # one GPU, shared


def test_bad_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("trainer:\n  total_steps: many\n")
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        load(p)
    with pytest.raises(ConfigError, match="key=value"):
        load(None, ["trainer.lr"])


def test_every_field_is_documented():
    rows = document()
    assert len(rows) > 40
    undocumented = [k for k, _, doc in rows if not doc]
    assert undocumented == []


def test_shipped_recipes_load(tmp_path, monkeypatch):
    load("configs/demo.yaml")
    with pytest.raises(ConfigError):  # the GPU recipe needs local paths: the error names them
        load("configs/gsm8k_qwen2.5_0.5b.yaml")
    multinode = "configs/gsm8k_qwen2.5_0.5b_multinode.yaml"
    paths = [f"model.path={tmp_path}", f"data.train_path={tmp_path / 'train.jsonl'}"]
    with pytest.raises(ConfigError, match="queue.redis_url"):  # the queue's Redis cannot be guessed either
        load(multinode, paths)
    # as the deploy files give it: the URL (its password) from the environment, never on the command line
    monkeypatch.setenv("ASYNCRL_REDIS_URL", "redis://:pw@10.0.0.1:6380/0")
    cfg = load(multinode, paths + ["queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}"])
    assert cfg.queue.redis_url == "redis://:pw@10.0.0.1:6380/0" and cfg.queue.metadata == "redis"
    assert cfg.trainer.mode == "fully_async" and cfg.trainer.gpus_per_rank == 1 and cfg.rollout.gpus_per_worker == 1
    assert cfg.weights.host == "auto" and cfg.queue.bind_host == "auto"
    assert cfg.weights.crosses_hosts and cfg.queue.crosses_hosts and cfg.weights.backend == "nccl"
    assert cfg.rollout.gpu_memory_utilization >= 0.8  # a server has its GPU alone
    big = load("configs/gsm8k_qwen2.5_7b_8gpu.yaml", paths)  # 7B on 8 GPUs: what keeps a step in memory
    t = big.trainer
    assert t.packing and t.gradient_checkpointing and t.max_tokens_per_micro_batch > 0 and t.logit_chunk_tokens > 0
    assert t.num_ranks + big.rollout.num_servers == 8 and big.weights.backend == "nccl" and big.model.dtype == "bfloat16"


def test_configs_readme_is_what_config_doc_prints():
    from asyncrl.config.doc import GENERATED, page

    head, found, rest = open("configs/README.md").read().partition(GENERATED)
    assert found and head.startswith("# Config keys"), "configs/README.md lost its generated line"
    assert found + rest == page(), "configs/README.md is stale: run bash scripts/gen_config_doc.sh"
    missing = [key for key, _, _ in document() if f"| `{key}` |" not in rest]
    assert missing == []


def test_config_doc_shows_every_policy_loss_setting():
    from asyncrl.config.doc import loss_settings_table, page

    table = loss_settings_table()
    assert table in page()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert {"`ppo_clip`", "`gspo`", "`cispo`", "`vanilla_pg`"} <= {r[0] for r in rows}
    assert ["`algorithm.loss_args.clip_ratio_c`", "`3.0`"] in [r[2:4] for r in rows]
    assert all(len(r) == 5 and r[4] for r in rows)  # every setting documented by its field's docstring


def test_config_command_help_doc_and_bad_option(capsys):
    from asyncrl.cli import main
    from asyncrl.config.doc import page

    for flag in ("--help", "-h"):
        assert main(["config", flag]) == 0
        assert capsys.readouterr().out.startswith("usage: asyncrl config [CONFIG.yaml] [key=value ...]")
    assert main(["config", "--doc"]) == 0
    assert capsys.readouterr().out == page()
    assert main(["config", "--nope"]) == 2
    assert "unknown option --nope" in capsys.readouterr().err


def test_loss_args_and_the_older_keys_roundtrip(tmp_path):
    from asyncrl.trainer.losses import GSPOSettings, PPOClipSettings

    cfg = load(None, ["algorithm.loss=gspo", "algorithm.gspo_clip_ratio_high=0.001", "algorithm.loss_args.seq_clip_ratio_low=0.0002"])
    assert cfg.algorithm.loss_settings() == GSPOSettings(seq_clip_ratio_low=2e-4, seq_clip_ratio_high=1e-3)
    dump_resolved(cfg, tmp_path / "config.yaml")
    again = load(tmp_path / "config.yaml")
    assert again == cfg and again.algorithm.loss_settings() == cfg.algorithm.loss_settings()
    assert load(None, ["algorithm.gspo_clip_ratio_low=0.5"]).algorithm.loss_settings() == PPOClipSettings()  # another loss's: ignored
    with pytest.raises(ConfigError, match=r"^algorithm\.clip_ratio_c: and algorithm\.loss_args\.clip_ratio_c are one setting"):
        load(None, ["algorithm.clip_ratio_c=4", "algorithm.loss_args.clip_ratio_c=5"])
