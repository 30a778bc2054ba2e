import asyncio
import json
import time

import pytest

from agents.scoring import score
from agents.rewards import get_reward
from agents.rewards.math import extract_answer, math_answer
from agents.rewards.reverse import reverse_digits
from asyncrl.data.datasets import BadLine, build_prompts, read_rows
from asyncrl.config import DataConfig
from asyncrl.data.tasks import build_task


def test_reverse_reward_partial_credit():
    assert reverse_digits("4321", "4321") == (1.0, {"exact": 1.0, "digit_acc": 1.0})
    assert reverse_digits("4300", "4321")[0] == pytest.approx(0.2 + 0.8 * 0.5)
    assert reverse_digits("43", "4321")[0] == pytest.approx(0.2 * 0.5 + 0.8 * 0.5)
    assert reverse_digits("43219999", "4321")[0] == pytest.approx(0.5)  # too long: scaled by 4/8
    assert reverse_digits("ab", "4321")[0] == 0.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so 3 + 4 = 7\n#### 7", "... #### 7", 1.0),
        ("The answer is \\boxed{1,000}.", "#### 1000", 1.0),
        ("I think 12 then 13", "#### 13", 0.0),  # no final-answer marker: no fallback to the last number
        ("I think 12 then 13", "#### 12", 0.0),
        ("#### 7.0", "#### 7", 1.0),
        ("no number here", "#### 7", 0.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ],
)
def test_math_answer(response, truth, expected):
    assert math_answer(response, truth)[0] == expected


def test_extract_answer_prefers_marker():
    assert extract_answer("first 5, #### 9 and later 11") == "9"


def test_jsonl_and_parquet_loader_with_math_reward(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2*i}\n#### {2*i}"} for i in range(20)]
    rows.append({"question": "no answer column"})
    rows.append({"question": "x" * 500, "answer": "#### 1"})
    jl = tmp_path / "gsm.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows[:20]), tmp_path / "gsm.parquet")
    assert len(read_rows(tmp_path / "gsm.parquet")) == 20
    enc = lambda s: [ord(c) for c in s]
    ps = build_prompts(read_rows(jl), enc, prompt_key="question", answer_key="answer", template="Q: {prompt}\nA:", max_prompt_tokens=100)
    assert len(ps) == 20 and ps.skipped == {"missing_field": 1, "too_long": 1}
    task = build_task(DataConfig(task="jsonl", train_path=str(jl), eval_size=5), enc)
    assert task.reward == "math_answer" and len(task.eval) == 5
    fn = get_reward(task.reward)
    p = task.train.prompts[0]
    assert fn("#### " + p.answer.split("####")[1].strip(), p.answer)[0] == 1.0


def test_bad_jsonl_line_is_kept_in_place_with_its_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question": "a", "answer": "1"}\nnot json\n')
    rows = read_rows(p)
    assert rows[0] == {"question": "a", "answer": "1"} and isinstance(rows[1], BadLine) and rows[1].line == 2


def test_reward_failures_are_counted_not_raised():
    def boom(r, a):
        raise RuntimeError("bad reward")

    def hang(r, a):
        time.sleep(5)
        return 1.0

    assert asyncio.run(score(boom, "x", "y", 1.0)) == (0.0, {"failed": "RuntimeError: bad reward"})
    assert asyncio.run(score(hang, "x", "y", 0.2)) == (0.0, {"failed": "timeout"})
    assert asyncio.run(score(lambda r, a: float("nan"), "x", "y", 1.0)) == (0.0, {"failed": "not finite: nan"})
    assert asyncio.run(score(lambda r, a: 0.5, "x", "y", 1.0)) == (0.5, {})


def test_reward_by_import_path_and_unknown():
    assert get_reward("agents.rewards.reverse:reverse_digits") is reverse_digits
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("nope")
