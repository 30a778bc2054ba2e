import dataclasses

import pytest

from agents.single_turn import SingleTurnAgent
from agents.tool_agent import ToolAgent
from asyncrl.config import ConfigError, load
from asyncrl.data.tasks import build_task
from asyncrl.rollout.host_spec import make_agent
from asyncrl.engines.base import SamplingParams


def _make(*overrides):
    cfg = load(None, list(overrides))
    enc = lambda s: [ord(c) for c in s]
    task = build_task(cfg.data, enc)
    return make_agent(dataclasses.asdict(cfg.agent), cfg.agent.reward or task.reward, enc, lambda ids: "".join(map(chr, ids)), SamplingParams())


def test_agent_chosen_from_config():
    assert isinstance(_make(), SingleTurnAgent)
    agent = _make("agent.name=tool", "agent.kwargs={tools: [calculator], max_turns: 2}")
    assert isinstance(agent, ToolAgent) and agent.max_turns == 2


@pytest.mark.parametrize("override, key", [("agent.name=nope", "agent.name"), ("agent.kwargs={bogus: 1}", "agent.kwargs"),
                                           ("agent.reward=nope", "agent.reward")])
def test_bad_agent_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        _make(override)
    assert str(e.value).startswith(key)
