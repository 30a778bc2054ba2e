"""PartialRollout bookkeeping and the fleet keys of `RolloutConfig`."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, RolloutConfig, load
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.fleet_build import fleet_configs
from asyncrl.rollout.partial import PartialRollout, segment_seed


def test_partial_rollout_segments():
    acc = PartialRollout([5, 6], SamplingParams(max_tokens=5, seed=7))
    assert acc.request() == ([5, 6], acc.sampling)
    acc.add(GenerateOutput("a", [9, 9], [-0.1, -0.2], [0, 0], "abort"))
    prompt, sp = acc.request()
    assert prompt == [5, 6, 9, 9] and sp.max_tokens == 3 and sp.seed == segment_seed(7, 2)
    acc.add(GenerateOutput("b", [], [], [], "abort"))  # aborted before its first token
    assert acc.request()[1].seed == sp.seed  # same cut, same seed
    acc.add(GenerateOutput("c", [4, 2], [-0.3, -0.4], [1, 1], "stop"))
    out = acc.result()
    assert out.token_ids == [9, 9, 4, 2] and out.versions == [0, 0, 1, 1] and out.finish_reason == "stop"
    assert acc.segments == 3
    with pytest.raises(RuntimeError):
        acc.request()
    full = PartialRollout([1], SamplingParams(max_tokens=2))
    full.add(GenerateOutput("a", [3, 3], [0.0, 0.0], [0, 0], "abort"))
    assert full.done and full.result().finish_reason == "length" and full.sampling.seed is None


def test_fleet_config_keys():
    cfg = load(None, ["rollout.num_servers=2", "rollout.fleets=[{name: big, num_servers: 3, temperature: 0.7}]"]).rollout
    fleets = fleet_configs(cfg)
    assert list(fleets) == ["main", "big"]
    assert fleets["big"].num_servers == 3 and fleets["big"].temperature == 0.7 and fleets["main"].num_servers == 2
    for bad, key in [({"name": "main"}, "rollout.fleets[0].name"), ({"name": "x", "nope": 1}, "rollout.fleets[0].nope")]:
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
            RolloutConfig(fleets=[bad])
    with pytest.raises(ConfigError, match="rollout.placement_strategy"):
        RolloutConfig(placement_strategy="ANY")
