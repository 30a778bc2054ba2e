"""Prompt files with bad rows: the good rows load, the bad ones are counted by reason and logged once;
a file with nothing usable (or no file) is a ConfigError naming the key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, DataConfig
from asyncrl.data.tasks import build_task, check_data_paths

enc = lambda s: [ord(c) for c in s]  # noqa: E731


def good(i: int) -> str:
    return json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"})


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


BAD = {
    "bad_json": ['{"question": "cut off', "not json at all"],
    "not_object": ["[1, 2]", '"a string"', "7"],
    "missing_field": [json.dumps({"question": "no answer"}), json.dumps({"answer": "1"}), json.dumps({"question": None, "answer": "1"})],
    "invalid_field": [json.dumps({"question": 5, "answer": "1"}), json.dumps({"question": "q", "answer": [1]}),
                      json.dumps({"question": "   ", "answer": "1"}), json.dumps({"question": "q", "answer": True})],
    "too_long": [json.dumps({"question": "x" * 500, "answer": "1"})],
}


@pytest.mark.timeout(30)
def test_bad_rows_are_skipped_counted_by_reason_and_logged_once(tmp_path, caplog):
    lines = [good(i) for i in range(10)]
    for bad in BAD.values():
        lines += bad
    lines += [good(i) for i in range(10, 14)]
    p = write(tmp_path / "train.jsonl", lines)
    with p.open("ab") as f:
        f.write(b'{"question": "\xff\xfe", "answer": "1"}\n')  # not UTF-8: bad_json too
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.tasks"):
        task = build_task(DataConfig(task="jsonl", train_path=str(p), eval_size=3, max_prompt_tokens=100), enc)
    assert len(task.eval) == 3 and len(task.train) == 11  # the 14 good rows, 3 held out
    expected = {k: len(v) for k, v in BAD.items()} | {"bad_json": 3}
    assert task.train.skipped == expected and task.eval.skipped == {}  # counted once per file
    assert [p_.answer for p_ in task.eval.prompts] == ["#### 0", "#### 2", "#### 4"]
    records = [r for r in caplog.records if r.name == "asyncrl.data.tasks"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert str(p) in line and "data.train_path" in line and "\n" not in line
    assert all(f"{k}={v}" in line for k, v in expected.items()) and f"skipped {sum(expected.values())} of " in line


@pytest.mark.timeout(30)
def test_eval_file_counts_are_its_own(tmp_path):
    train = write(tmp_path / "train.jsonl", [good(i) for i in range(5)])
    held = write(tmp_path / "eval.jsonl", [good(i) for i in range(4)] + ["[]", "{bad"])
    task = build_task(DataConfig(task="jsonl", train_path=str(train), eval_path=str(held), eval_size=2), enc)
    assert (len(task.train), task.train.skipped) == (5, {})
    assert (len(task.eval), task.eval.skipped) == (2, {"not_object": 1, "bad_json": 1})


@pytest.mark.timeout(30)
def test_a_file_with_no_usable_row_names_the_key_and_the_counts(tmp_path):
    p = write(tmp_path / "bad.jsonl", BAD["bad_json"] + BAD["not_object"] + BAD["too_long"])
    with pytest.raises(ConfigError) as e:
        build_task(DataConfig(task="jsonl", train_path=str(p), max_prompt_tokens=100), enc)
    msg = str(e.value)
    assert msg.startswith("data.train_path:") and str(p) in msg
    assert "bad_json=2" in msg and "not_object=3" in msg and "too_long=1" in msg and "data.max_prompt_tokens" in msg
    train = write(tmp_path / "train.jsonl", [good(i) for i in range(5)])
    empty = write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ConfigError, match=r"^data\.eval_path: no usable row .*the file is empty"):
        build_task(DataConfig(task="jsonl", train_path=str(train), eval_path=str(empty)), enc)


@pytest.mark.timeout(30)
def test_missing_or_unreadable_files_are_config_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    cfg = DataConfig(task="jsonl", train_path=missing)
    for check in (lambda: check_data_paths(cfg), lambda: build_task(cfg, enc)):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == f"data.train_path: file {missing!r} not found"
    train = write(tmp_path / "train.jsonl", [good(i) for i in range(5)])
    with pytest.raises(ConfigError, match="^data.eval_path: file"):
        check_data_paths(DataConfig(task="jsonl", train_path=str(train), eval_path=missing))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ConfigError, match="^data.train_path: .*not a readable parquet file"):
        build_task(DataConfig(task="jsonl", train_path=str(broken)), enc)
    with pytest.raises(ConfigError, match="^data.eval_size"):  # the good rows are all held out
        build_task(DataConfig(task="jsonl", train_path=str(train), eval_size=5), enc)


@pytest.mark.timeout(30)
def test_rows_the_chat_template_rejects_are_counted_and_named(tmp_path):
    from tests.unit.data.conftest import CHATML, _save_tokenizer
    from transformers import AutoTokenizer

    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + CHATML
    tok = AutoTokenizer.from_pretrained(str(_save_tokenizer(tmp_path / "tok", strict)))
    user = lambda i: json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "answer": "1"})  # noqa: E731
    system = json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "answer": "1"})
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    task = build_task(DataConfig(task="jsonl", train_path=str(write(tmp_path / "t.jsonl", [user(i) for i in range(4)] + [system] * 2)),
                                 eval_size=1), enc, tokenizer=tok)
    assert (len(task.train), task.train.skipped) == (3, {"template_error": 2})
    with pytest.raises(ConfigError, match=r"^data\.train_path: no usable row .*template_error=2.*see data\.chat_template"):
        build_task(DataConfig(task="jsonl", train_path=str(write(tmp_path / "s.jsonl", [system] * 2))), enc, tokenizer=tok)
