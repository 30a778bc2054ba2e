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


def test_shipped_recipes_load():
    load("configs/demo.yaml")
    with pytest.raises(ConfigError):  # the GPU recipe needs local paths: the error names them
        load("configs/gsm8k_qwen2.5_0.5b.yaml")


def test_configs_readme_documents_every_key():
    text = open("configs/README.md").read()
    missing = [key for key, _, _ in document() if f"| `{key}` |" not in text]
    assert missing == [], f"configs/README.md is stale (run `asyncrl config --doc`): {missing}"
