"""`asyncrl data convert`: GSM8K-style rows -> verl's parquet layout, loaded unchanged by the trainer's loader
(chat prompts rendered by the template, ground truth `72` rather than the worked answer, reward `gsm8k`); bad rows
counted by reason; exit codes; parquet, JSON-array and plain inputs; the commands of docs/real_job.md as written,
through the installed `asyncrl` executable."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agents.rewards import get_reward
from asyncrl.cli import main
from asyncrl.config import DataConfig
from asyncrl.data.convert import GSM8K_INSTRUCTION
from asyncrl.data.datasets import read_rows
from asyncrl.data.tasks import build_task
from asyncrl.rollout.host_spec import tokenizer_codec
from tests.unit.data.conftest import write_parquet

ROOT = Path(__file__).resolve().parents[3]
NATALIA_Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?")
NATALIA_A = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def gsm8k_rows(n: int) -> list[dict[str, str]]:
    """Rows in GSM8K's own layout: Natalia's, then `i` boxes of 500 (`#### 1,000` for i = 2)."""
    return [{"question": NATALIA_Q, "answer": NATALIA_A}] + [
        {"question": f"Tom has {i} boxes of 500 clips. How many clips?", "answer": f"{i} * 500 = {i * 500}\n#### {i * 500:,}"}
        for i in range(1, n)]


def _jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _task(out: Path, tokenizer, eval_size: int = 1):
    encode, _ = tokenizer_codec(tokenizer)
    return build_task(DataConfig(task="jsonl", train_path=str(out), eval_size=eval_size, max_prompt_tokens=2048), encode,
                      tokenizer=tokenizer)


@pytest.mark.timeout(30)
def test_gsm8k_jsonl_becomes_verl_parquet_that_the_trainer_loads(tmp_path, chatml_tokenizer, capsys):
    src, out = _jsonl(tmp_path / "train.jsonl", gsm8k_rows(4)), tmp_path / "gsm8k" / "train.parquet"
    assert main(["data", "convert", str(src), str(out)]) == 0
    assert capsys.readouterr().out == f"asyncrl data: wrote 4 rows to {out}\n"
    content = f"{NATALIA_Q} {GSM8K_INSTRUCTION}"
    rows = read_rows(out)
    assert rows[0] == {
        "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": content}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": NATALIA_A, "question": NATALIA_Q}}
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "500", "1000", "1500"]  # `1,000`: commas removed
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.parquet"]  # no temporary file left

    task = _task(out, chatml_tokenizer)
    assert (task.reward, len(task.train), len(task.eval)) == ("gsm8k", 3, 1)
    natalia = task.eval.prompts[0]
    assert natalia.text == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    assert (natalia.answer, natalia.data_source) == ("72", "openai/gsm8k")
    reward = get_reward(task.reward)
    assert reward("... so 72 clips.\n#### 72", natalia.answer)[0] == 1.0
    assert reward("#### 71", natalia.answer)[0] == 0.0


@pytest.mark.timeout(30)
def test_bad_rows_are_skipped_and_counted_by_reason_once(tmp_path, capsys):
    lines = [
        "[1, 2]",                                      # not_object
        "{bad",                                        # bad_json
        {"answer": "#### 1"},                          # no_question: absent
        {"question": NATALIA_Q, "answer": NATALIA_A},  # the usable row, 4th of the input
        {"question": "  ", "answer": "#### 1"},        # no_question: blank
        {"question": "q?", "answer": "1 + 1 = 2"},     # no_answer: no ####
        {"question": "q?"},                            # no_answer: absent
        {"question": "q?", "answer": "#### "},         # no_answer: nothing after ####
        {"question": "q?", "answer": True},            # no_answer: not a string or number
    ]
    src, out = _jsonl(tmp_path / "mixed.jsonl", lines), tmp_path / "out.parquet"
    assert main(["data", "convert", str(src), str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == f"asyncrl data: wrote 1 rows to {out} (skipped: bad_json=1, not_object=1, no_question=2, no_answer=4)\n"
    (row,) = read_rows(out)
    assert (row["extra_info"]["index"], row["reward_model"]["ground_truth"]) == (3, "72")  # index: position in the input


@pytest.mark.timeout(30)
def test_exit_codes_and_one_line_errors(tmp_path, capsys):
    src, out = _jsonl(tmp_path / "train.jsonl", gsm8k_rows(3)), tmp_path / "out.parquet"

    def run(*args: str) -> tuple[int, str]:
        rc = main(["data", *args])
        err = capsys.readouterr().err
        return rc, err

    rc, err = run("convert", str(tmp_path / "nope.jsonl"), str(out))
    assert (rc, err) == (2, f"asyncrl data: error: IN {str(tmp_path / 'nope.jsonl')!r} not found\n") and not out.exists()
    empty = _jsonl(tmp_path / "empty.jsonl", [{"question": "q?", "answer": "no mark"}, "[]"])
    rc, err = run("convert", str(empty), str(out))
    assert rc == 2 and err == f"asyncrl data: error: no usable row in IN {str(empty)!r} (not_object=1, no_answer=1)\n"
    other = _jsonl(tmp_path / "other.jsonl", [{"problem": "q?", "solution": "#### 1"}])
    rc, err = run("convert", str(other), str(out))
    assert rc == 2 and "no question column 'question'; columns found: ['problem', 'solution'] (set --question-key)" in err
    rc, err = run("convert", str(src), str(tmp_path / "out.jsonl"))
    assert rc == 2 and "must end in .parquet" in err
    assert not out.exists()

    assert run("convert", str(src), str(out))[0] == 0
    before = out.read_bytes()
    rc, err = run("convert", str(_jsonl(tmp_path / "two.jsonl", gsm8k_rows(2))), str(out))
    assert (rc, err) == (2, f"asyncrl data: error: OUT {str(out)!r} exists; give --force to replace it\n")
    assert out.read_bytes() == before  # untouched
    assert run("convert", str(tmp_path / "two.jsonl"), str(out), "--force")[0] == 0
    assert len(read_rows(out)) == 2

    assert main(["data", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "asyncrl data convert IN OUT" in help_text and "docs/real_job.md" in help_text
    assert main(["data"]) == 2
    assert run("convert", str(src))[0] == 2  # no OUT: argparse's usage error, as a return code
    assert run("convert", str(src), str(out), "--source", "csv")[0] == 2


@pytest.mark.timeout(30)
def test_parquet_json_array_and_plain_inputs(tmp_path, chatml_tokenizer, capsys):
    pq_in = write_parquet(tmp_path / "gsm8k.parquet", gsm8k_rows(3))
    assert main(["data", "convert", str(pq_in), str(tmp_path / "a.parquet"), "--split", "test"]) == 0
    rows = read_rows(tmp_path / "a.parquet")
    assert [(r["reward_model"]["ground_truth"], r["extra_info"]["split"]) for r in rows] == [("72", "test"), ("500", "test"),
                                                                                              ("1000", "test")]
    arr = tmp_path / "gsm8k.json"
    arr.write_text(json.dumps(gsm8k_rows(3), indent=2))  # one JSON array, not lines
    assert main(["data", "convert", str(arr), str(tmp_path / "b.parquet")]) == 0
    assert [r["reward_model"]["ground_truth"] for r in read_rows(tmp_path / "b.parquet")] == ["72", "500", "1000"]

    plain = _jsonl(tmp_path / "plain.jsonl", [{"problem": {"text": f"{i} + {i} = ?"}, "solution": 2 * i} for i in range(3)]
                   + [{"problem": {"text": "x?"}, "solution": " "}])
    out = tmp_path / "plain.parquet"
    assert main(["data", "convert", str(plain), str(out), "--source", "plain", "--question-key", "problem.text",
                 "--answer-key", "solution", "--instruction", "", "--data-source", "DigitalLearningGmbH/MATH-lighteval"]) == 0
    assert capsys.readouterr().out.endswith(f"wrote 3 rows to {out} (skipped: no_answer=1)\n")
    row = read_rows(out)[1]
    assert (row["prompt"], row["reward_model"]["ground_truth"], row["extra_info"]["answer"]) == (
        [{"role": "user", "content": "1 + 1 = ?"}], "2", "2")
    task = _task(out, chatml_tokenizer)
    assert (task.reward, task.eval.prompts[0].answer) == ("math", "0")

    # plain rows keep a `####` answer as given; no --data-source: empty, scored by `math_answer`
    assert main(["data", "convert", str(pq_in), str(tmp_path / "c.parquet"), "--source", "plain"]) == 0
    row = read_rows(tmp_path / "c.parquet")[0]
    assert (row["data_source"], row["reward_model"]["ground_truth"]) == ("", NATALIA_A)
    task = _task(tmp_path / "c.parquet", chatml_tokenizer)
    assert (task.reward, task.eval.prompts[0].answer) == ("math_answer", NATALIA_A)


@pytest.mark.timeout(60)
def test_the_convert_commands_of_docs_real_job_run_as_written(tmp_path):
    """Every `asyncrl data convert` line of docs/real_job.md's fenced blocks, `/data/` moved under tmp_path, through
    the installed executable; the GSM8K files are named as the dataset repository names them."""
    page = (ROOT / "docs" / "real_job.md").read_text()
    blocks = page.split("```")[1::2]
    commands = [ln for b in blocks for ln in b.splitlines() if ln.startswith("asyncrl data convert ")]
    assert len(commands) == 3, commands
    raw = tmp_path / "data" / "gsm8k-raw" / "main"
    raw.mkdir(parents=True)
    write_parquet(raw / "train-00000-of-00001.parquet", gsm8k_rows(5))
    write_parquet(raw / "test-00000-of-00001.parquet", gsm8k_rows(2))
    _jsonl(tmp_path / "problems.jsonl", [{"problem": "1 + 1 = ?", "solution": "2"}])
    exe = Path(sys.executable).parent / "asyncrl"
    for cmd in commands:
        args = [a.replace("/data/", f"{tmp_path}/data/", 1) if a.startswith("/data/") else a for a in shlex.split(cmd)]
        done = subprocess.run([str(exe), *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and done.stdout.startswith("asyncrl data: wrote "), (cmd, done.stdout, done.stderr)
    for split, n in (("train", 5), ("test", 2)):
        rows = read_rows(tmp_path / "data" / "gsm8k" / f"{split}.parquet")
        assert len(rows) == n and {r["extra_info"]["split"] for r in rows} == {split}
    assert read_rows(tmp_path / "data" / "mine" / "train.parquet")[0]["reward_model"]["ground_truth"] == "2"

    # `asyncrl data` answers without importing torch (the dispatch is before anything heavy)
    probe = ("import sys; from asyncrl.cli import main; rc = main(['data', 'convert', sys.argv[1], sys.argv[2]]); "
             "print(rc, [m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe, str(raw / "test-00000-of-00001.parquet"), str(tmp_path / "t.parquet")],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines()[-1] == "0 []", (done.stdout, done.stderr)
