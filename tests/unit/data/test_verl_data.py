"""verl-format data through `build_task`: chat and string prompts rendered by the tokenizer's chat template,
ground truth from `reward_model.ground_truth`, the reward from `data_source`, and the errors a user meets
(a missing column, chat data without a template, mixed or unknown data sources) naming the key to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, DataConfig
from asyncrl.data.tasks import build_task, check_data_paths
from asyncrl.rollout.host_spec import tokenizer_codec
from tests.unit.data.conftest import CHATML, verl_row, write_parquet


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(30)
def test_verl_parquet_chat_prompts_are_rendered_by_the_template(tmp_path, chatml_tokenizer):
    train = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(6)])
    test = write_parquet(tmp_path / "test.parquet", [verl_row(100 + i) for i in range(3)])
    encode, _ = tokenizer_codec(chatml_tokenizer)
    task = build_task(DataConfig(task="jsonl", train_path=str(train), eval_path=str(test), eval_size=2), encode,
                      tokenizer=chatml_tokenizer)
    assert (len(task.train), len(task.eval), task.reward) == (6, 2, "gsm8k")
    p = task.train.prompts[3]
    content = verl_row(3)["prompt"][0]["content"]
    assert p.text == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    assert p.prompt_ids == chatml_tokenizer(p.text, add_special_tokens=False)["input_ids"]
    assert p.prompt_ids[0] == chatml_tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token, not its characters
    assert (p.answer, p.data_source, p.index) == ("6", "openai/gsm8k", 3)
    assert [q.answer for q in task.eval.prompts] == ["200", "202"]


@pytest.mark.timeout(30)
def test_string_prompts_become_one_user_message_and_none_turns_it_off(tmp_path, chatml_tokenizer):
    rows = [verl_row(i, chat=False) for i in range(4)] + [{"question": "flat?", "answer": "#### 1"}]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    encode, _ = tokenizer_codec(chatml_tokenizer)
    cfg = DataConfig(task="jsonl", train_path=str(train), eval_size=1, prompt_template="Q: {prompt}")
    task = build_task(cfg, encode, tokenizer=chatml_tokenizer)
    q = verl_row(0, chat=False)["prompt"]
    assert task.eval.prompts[0].text == f"<|im_start|>user\nQ: {q}<|im_end|>\n<|im_start|>assistant\n"
    assert task.train.skipped == {"missing_field": 1}  # the flat row lacks `prompt`: counted, not silent
    cfg.chat_template = "none"
    assert build_task(cfg, encode, tokenizer=chatml_tokenizer).eval.prompts[0].text == f"Q: {q}"


@pytest.mark.timeout(30)
def test_flat_gsm8k_rows_and_dotted_keys_still_load(tmp_path, plain_tokenizer):
    flat = _jsonl(tmp_path / "flat.jsonl", [{"question": f"{i}+{i}?", "answer": f"#### {2 * i}"} for i in range(4)])
    encode, _ = tokenizer_codec(plain_tokenizer)
    task = build_task(DataConfig(task="jsonl", train_path=str(flat), eval_size=1), encode, tokenizer=plain_tokenizer)
    assert (task.reward, task.eval.prompts[0].text, task.eval.prompts[0].answer) == ("math_answer", "0+0?\n", "#### 0")
    nested = _jsonl(tmp_path / "nested.jsonl", [{"q": {"text": f"{i}?"}, "gt": {"v": i}} for i in range(3)])
    task = build_task(DataConfig(task="jsonl", train_path=str(nested), eval_size=1, prompt_key="q.text", answer_key="gt.v"),
                      encode, tokenizer=plain_tokenizer)
    assert [(p.text, p.answer) for p in task.train.prompts] == [("1?\n", "1"), ("2?\n", "2")]


@pytest.mark.timeout(30)
def test_a_missing_column_names_what_was_wanted_and_what_was_found(tmp_path, chatml_tokenizer):
    encode, _ = tokenizer_codec(chatml_tokenizer)
    rows = [{"problem": "1+1?", "solution": "2", "meta": {"level": 1}}] * 3
    p = write_parquet(tmp_path / "other.parquet", rows)
    with pytest.raises(ConfigError) as e:
        build_task(DataConfig(task="jsonl", train_path=str(p)), encode, tokenizer=chatml_tokenizer)
    msg = str(e.value)
    assert msg.startswith("data.train_path:") and str(p) in msg and "data.prompt_key" in msg
    assert "'prompt' or 'question'" in msg and "['problem', 'solution', 'meta', 'meta.level']" in msg
    with pytest.raises(ConfigError) as e:
        build_task(DataConfig(task="jsonl", train_path=str(p), prompt_key="problem"), encode, tokenizer=chatml_tokenizer)
    assert "'reward_model.ground_truth' or 'answer'" in str(e.value) and "data.answer_key" in str(e.value)
    with pytest.raises(ConfigError, match=r"no answer column 'gt'; columns found"):
        build_task(DataConfig(task="jsonl", train_path=str(p), prompt_key="problem", answer_key="gt"), encode,
                   tokenizer=chatml_tokenizer)


@pytest.mark.timeout(30)
def test_chat_data_without_a_template_names_data_chat_template(tmp_path, plain_tokenizer):
    train = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(4)])
    encode, _ = tokenizer_codec(plain_tokenizer)
    for setting, why in (("auto", "the tokenizer has no chat template"), ("none", "data.chat_template=none")):
        with pytest.raises(ConfigError) as e:
            build_task(DataConfig(task="jsonl", train_path=str(train), eval_size=1, chat_template=setting), encode,
                       tokenizer=plain_tokenizer)
        assert str(e.value).startswith("data.chat_template:") and why in str(e.value) and str(train) in str(e.value)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    task = build_task(DataConfig(task="jsonl", train_path=str(train), eval_size=1, chat_template=str(template)), encode,
                      tokenizer=plain_tokenizer)
    assert task.eval.prompts[0].text.startswith("<|im_start|>user\n") and task.eval.prompts[0].text.endswith("assistant\n")
    missing = DataConfig(task="jsonl", train_path=str(train), chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(ConfigError, match=r"^data\.chat_template: file .*nope\.jinja.* not found"):
        check_data_paths(missing)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match=r"^data\.chat_template: the chat template .* cannot render"):
        build_task(DataConfig(task="jsonl", train_path=str(train), chat_template=str(broken)), encode, tokenizer=plain_tokenizer)


@pytest.mark.timeout(30)
def test_reward_follows_data_source_and_agent_reward_overrides_it(tmp_path, chatml_tokenizer):
    encode, _ = tokenizer_codec(chatml_tokenizer)
    math = write_parquet(tmp_path / "math.parquet", [verl_row(i, source="DigitalLearningGmbH/MATH-lighteval") for i in range(3)])
    assert build_task(DataConfig(task="jsonl", train_path=str(math), eval_size=1), encode, tokenizer=chatml_tokenizer).reward == "math"
    mixed = write_parquet(tmp_path / "mixed.parquet", [verl_row(0), verl_row(1, source="lighteval/MATH"), verl_row(2)])
    unknown = write_parquet(tmp_path / "unknown.parquet", [verl_row(i, source="my_set") for i in range(3)])
    for path, what in ((mixed, "different rewards"), (unknown, "no reward is registered for data_source ['my_set']")):
        cfg = DataConfig(task="jsonl", train_path=str(path), eval_size=1)
        with pytest.raises(ConfigError) as e:
            build_task(cfg, encode, tokenizer=chatml_tokenizer)
        assert str(e.value).startswith("agent.reward:") and what in str(e.value)
        assert build_task(cfg, encode, tokenizer=chatml_tokenizer, reward="gsm8k").reward == "gsm8k"


@pytest.mark.timeout(30)
def test_demo_digit_tasks_stay_untemplated_with_the_character_tokenizer():
    from asyncrl.data.tiny_model import build_tokenizer

    tok = build_tokenizer()
    assert not getattr(tok, "chat_template", None)
    encode, _ = tokenizer_codec(tok)
    cfg = DataConfig(eval_size=4)
    with_tok, without = build_task(cfg, encode, tokenizer=tok), build_task(cfg, encode)
    assert [p.text for p in with_tok.eval.prompts] == [p.text for p in without.eval.prompts]
    assert all(len(p.text) == cfg.num_digits + 1 and p.text.endswith("=") for p in with_tok.train.prompts)
    assert with_tok.reward == "digits" and with_tok.train.prompts[0].prompt_ids == without.train.prompts[0].prompt_ids


@pytest.mark.timeout(30)
def test_a_datasets_folder_loads_or_names_what_it_needs(tmp_path, chatml_tokenizer):
    encode, _ = tokenizer_codec(chatml_tokenizer)
    folder = tmp_path / "gsm8k_train"
    try:
        import datasets
    except ImportError:
        folder.mkdir()
        (folder / "state.json").write_text("{}")
        check_data_paths(DataConfig(task="jsonl", train_path=str(folder)))  # a folder exists: not "not found"
        with pytest.raises(ConfigError, match=r"^data\.train_path: .* is a folder: .*needs the `datasets` package"):
            build_task(DataConfig(task="jsonl", train_path=str(folder)), encode, tokenizer=chatml_tokenizer)
        return
    datasets.Dataset.from_list([verl_row(i) for i in range(4)]).save_to_disk(str(folder))
    task = build_task(DataConfig(task="jsonl", train_path=str(folder), eval_size=1), encode, tokenizer=chatml_tokenizer)
    assert (len(task.train), task.reward, task.eval.prompts[0].answer) == (3, "gsm8k", "0")
