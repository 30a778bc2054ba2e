"""`load.load_sharded_model` builds on the meta device and rank 0 alone reads the folder: 2 gloo ranks
(real processes under torchrun) and 1 rank load what the folder holds, bit for bit (load_harness.py
checks each rank), draw the same new weights, and a folder that does not fit is an error naming it."""

import os
import shutil
import subprocess
import sys

import pytest
import torch


def tied_model(path) -> str:
    """A small Qwen2 whose LM head is its embedding (`tie_word_embeddings`), saved like the tiny model."""
    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_one_and_two_ranks_load_what_the_folder_holds(tiny_model_path, tmp_path):
    from tests.integration.trainer.load_harness import main

    tied = tied_model(tmp_path / "tied")
    args = ["--model", tiny_model_path, "--tied", tied]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(os.path.dirname(__file__), "load_harness.py"), *args, "--out", str(tmp_path / "r2.pt")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        main([*args, "--out", str(tmp_path / "r1.pt")])  # one rank, in this process
        log, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-4000:]
    assert log.count("loads match the folders") == 2
    one, two = torch.load(tmp_path / "r1.pt"), torch.load(tmp_path / "r2.pt")
    assert (one["world"], two["world"]) == (1, 2)
    for part in ("head", "adapters"):  # drawn, not read: the same on 1 and 2 ranks
        assert one[part].keys() == two[part].keys()
        assert all(torch.equal(one[part][k], two[part][k]) for k in one[part]), part


def test_a_folder_that_does_not_fit_is_an_error_naming_it(tiny_model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    from asyncrl.trainer.load import load_sharded_model
    from asyncrl.trainer.setup import ensure_process_group

    sd = load_file(f"{tiny_model_path}/model.safetensors")
    lacking, extra, empty = tmp_path / "lacking", tmp_path / "extra", tmp_path / "empty"
    for folder, tensors in ((lacking, {k: v for k, v in sd.items() if k != "model.norm.weight"}),
                            (extra, {**sd, "model.layers.0.mlp.gate.weight": torch.zeros(2)})):
        shutil.copytree(tiny_model_path, folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(tiny_model_path, empty, ignore=shutil.ignore_patterns("*.safetensors"))
    owns = ensure_process_group(torch.device("cpu"))
    try:
        with pytest.raises(ValueError, match=rf"{lacking}: .*missing \(1\): model.norm.weight"):
            load_sharded_model(str(lacking), torch.device("cpu"), torch.float32, trainable=True)
        with pytest.raises(ValueError, match=rf"{extra}: .*unexpected \(1\): model.layers.0.mlp.gate.weight"):
            load_sharded_model(str(extra), torch.device("cpu"), torch.float32, trainable=True)
        with pytest.raises(FileNotFoundError, match=rf"{empty}: no model.safetensors"):
            load_sharded_model(str(empty), torch.device("cpu"), torch.float32, trainable=True)
    finally:
        if owns:
            torch.distributed.destroy_process_group()


def test_the_load_bench_quick_peaks_below_the_old_load(capsys):
    """`asyncrl bench trainer-load --quick --json`: every rank's figures, the new load's peak RSS below the old one's."""
    import json

    from asyncrl.bench.trainer_load import main

    assert main(["--quick", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in res["ranks"]] == [0, 1]
    for r in res["ranks"]:
        assert {"peak_rss_mb_new", "peak_rss_mb_old", "target_mb", "ratio_new_to_target", "ratio_old_to_target"} <= r.keys()
        assert r["peak_rss_mb_new"] < r["peak_rss_mb_old"] and r["ratio_new_to_target"] < r["ratio_old_to_target"]
