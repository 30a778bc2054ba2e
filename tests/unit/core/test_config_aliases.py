"""The verl key map: every asyncrl key it names exists, every foreign key gets its hint at load, docs/verl.md shows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load
from asyncrl.config.aliases import ALIASES, BEGIN, END, hint, markdown_table
from asyncrl.config.doc import asyncrl_keys

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "verl.md"


def page_table() -> list[tuple[str, list[str]]]:
    """(verl key, asyncrl keys) of every row of the key map as docs/verl.md shows it."""
    text = PAGE.read_text()
    assert BEGIN in text and END in text, "docs/verl.md lost its key-map markers"
    rows = []
    for line in text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()[2:]:
        verl, ours, _ = (c.strip() for c in line.strip("|").split("|", 2))
        rows.append((verl.strip("`"), [k.strip().strip("`") for k in ours.split(",") if k.strip() != "—"]))
    return rows


@pytest.mark.timeout(30)
def test_docs_page_shows_the_table_of_the_module():
    text = PAGE.read_text()
    assert f"{BEGIN}\n{markdown_table()}{END}" in text, "regenerate: python -m asyncrl.config.aliases --write docs/verl.md"
    assert len(page_table()) == len(ALIASES) >= 40


@pytest.mark.timeout(30)
def test_every_asyncrl_key_on_the_page_exists_in_the_config():
    keys = asyncrl_keys()
    assert {"model.path", "rollout.group_size", "trainer.prompts_per_step"} <= keys
    missing = [(verl, k) for verl, ours in page_table() for k in ours if k not in keys]
    assert not missing, f"keys on docs/verl.md that the config does not have: {missing}"
    assert not [a.key for a in ALIASES if a.key in keys], "a foreign key that is also an asyncrl key would never reach the hint"


@pytest.mark.timeout(30)
def test_every_verl_key_on_the_page_gets_its_hint_at_load():
    for verl, ours in page_table():
        with pytest.raises(ConfigError) as e:
            load(None, [f"{verl}=1"])
        msg = str(e.value)
        assert msg.startswith(f"{verl}: unknown key"), msg
        for k in ours:
            assert k in msg, msg
        if not ours:
            assert "no asyncrl key" in msg, msg


@pytest.mark.timeout(30)
def test_the_named_examples_of_issue_13(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.engine: unknown key \(in the overrides\); in asyncrl it is rollout\.backend"):
        load(None, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.n: .* rollout\.group_size"):
        load(None, ["actor_rollout_ref.rollout.n=4"])
    with pytest.raises(ConfigError, match=r"trainer\.minibatches = data\.train_batch_size / ppo_mini_batch_size"):
        load(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    recipe = tmp_path / "verl.yaml"  # nested, in a recipe: the full dotted key and the file are named
    recipe.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n")
    with pytest.raises(ConfigError, match=rf"^actor_rollout_ref\.actor\.optim\.lr: unknown key \(in {recipe}\); in asyncrl it is trainer\.lr$"):
        load(recipe)


@pytest.mark.timeout(30)
def test_keys_not_in_the_table_get_a_section_match_or_a_close_key():
    assert hint("actor_rollout_ref.rollout.max_failovers", asyncrl_keys()) == "in asyncrl it is rollout.max_failovers"
    assert hint("actor_rollout_ref.actor.kl_estimator", asyncrl_keys()) == "in asyncrl it is algorithm.kl_estimator"
    with pytest.raises(ConfigError, match=r"^trainer\.totl_steps: .*did you mean trainer\.total_steps\?$"):
        load(None, ["trainer.totl_steps=3"])
    with pytest.raises(ConfigError, match=r"did you mean rollout\.cost_model\.jitter\?"):
        load(None, ["rollout.cost_model.jiter=0.1"])
    with pytest.raises(ConfigError, match=r"^trainer\.zzzz: unknown key .*trainer has no such key"):
        load(None, ["trainer.zzzz=1"])
    with pytest.raises(ConfigError, match=r"^foo\.bar: .*no section 'foo' \(sections: agent, algorithm"):
        load(None, ["foo.bar=1"])
    # keys under a mapping-valued field are the agent's, not unknown
    assert load(None, ["agent.kwargs.max_turns=3"]).agent.kwargs == {"max_turns": 3}


@pytest.mark.timeout(30)
def test_unset_mandatory_key_names_the_key_and_the_recipe(tmp_path):
    recipe = ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"
    with pytest.raises(ConfigError) as e:
        load(recipe)
    assert str(e.value).startswith(f"model.path: required by {recipe}, not set"), e.value
    assert "also not set: data.train_path" in str(e.value)
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    with pytest.raises(ConfigError, match=r"^data\.train_path: required by .*gsm8k_qwen2\.5_0\.5b\.yaml, not set"):
        load(recipe, [f"model.path={tmp_path}"])
    cfg = load(recipe, [f"model.path={tmp_path}", f"data.train_path={data}"])
    assert cfg.model.path == str(tmp_path) and cfg.data.train_path == str(data)
    with pytest.raises(ConfigError, match=r"^trainer\.lr: required, not set"):
        load(None, ["trainer.lr=???"])
    # a later override that sets the key wins over the recipe's ???; one that leaves it ??? does not
    with pytest.raises(ConfigError, match=r"^model\.path: required"):
        load(recipe, ["model.path=???", f"data.train_path={data}"])
