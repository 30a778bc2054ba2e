"""`asyncrl.registry.Registry`: duplicates refused, the `module:attr` escape, errors naming the config key,
and config validating algorithm names against the registries (a user's advantage passes load and is used)."""

from __future__ import annotations

import pytest

from asyncrl.config import AlgorithmConfig, ConfigError, load
from asyncrl.registry import Registry, UnknownName
from asyncrl.trainer.advantages import ADVANTAGES, TOKEN_LEVEL_ADVANTAGES, compute_advantages, register_advantage
from asyncrl.trainer.corrections import CORRECTIONS
from asyncrl.trainer.losses import POLICY_LOSSES
from tests.unit.core import user_advantage

REWARDS = [3.0, 1.0, 2.0, 0.0, 0.0]
GROUPS = ["a", "a", "a", "b", "c"]


@pytest.mark.timeout(10)
def test_registry_register_get_and_errors():
    reg: Registry[object] = Registry("widget", "demo.widget")
    deco = reg.register("b")
    fn = lambda: 1  # noqa: E731
    assert deco(fn) is fn and reg.add("a", len) is len
    assert reg["b"] is fn and reg.get("a") is len and "a" in reg and "c" not in reg
    assert list(reg) == ["b", "a"] and sorted(reg) == reg.names() == ["a", "b"] and len(reg) == 2
    with pytest.raises(ValueError, match="widget 'a' registered twice"):
        reg.register("a")(abs)
    assert reg["a"] is len  # the first entry stays
    assert reg.get("tests.unit.core.user_advantage:doubled_centred") is user_advantage.doubled_centred
    assert reg.accepts("pkg.mod:anything") and not reg.accepts("c")
    with pytest.raises(UnknownName) as e:
        reg.get("c")
    assert str(e.value) == "demo.widget: unknown widget 'c'; registered: ['a', 'b'] (or give module:attr)"
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    with pytest.raises(KeyError, match="demo.widget: unknown widget 'c'"):
        reg["c"]
    with pytest.raises(UnknownName, match="demo.widget: widget .* has no callable 'NOT_CALLABLE'"):
        reg.get("tests.unit.core.user_advantage:NOT_CALLABLE")
    with pytest.raises(ModuleNotFoundError):
        reg.get("tests.no_such_module:fn")
    closed: Registry[object] = Registry("thing", "demo.thing", import_paths=False)
    with pytest.raises(UnknownName, match=r"demo.thing: unknown thing 'math:sqrt'; registered: \[\]$"):
        closed.get("math:sqrt")
    assert not closed.accepts("math:sqrt")


@pytest.mark.timeout(10)
def test_the_seven_registries_refuse_duplicates_and_name_their_key():
    from agents.registry import AGENTS, register_agent
    from agents.rewards import REWARDS as REWARD_FNS, register_reward
    from agents.tool_parsers import PARSERS, register_parser
    from agents.tools import TOOLS, register_tool
    from asyncrl.trainer.corrections import register_correction
    from asyncrl.trainer.losses import register_policy_loss

    cases = [(ADVANTAGES, register_advantage, "grpo", "algorithm.advantage"),
             (POLICY_LOSSES, register_policy_loss, "ppo_clip", "algorithm.loss"),
             (CORRECTIONS, lambda n: register_correction(n, uses_proximal=True), "tis", "algorithm.correction"),
             (AGENTS, register_agent, "tool", "agent.name"), (REWARD_FNS, register_reward, "gsm8k", "agent.reward"),
             (TOOLS, register_tool, "calculator", "agent.kwargs.tools"), (PARSERS, register_parser, "hermes", "agent.kwargs.parser")]
    for registry, register, builtin, key in cases:
        before = registry[builtin]
        with pytest.raises(ValueError, match="registered twice"):
            register(builtin)(lambda *a, **k: None)
        assert registry[builtin] is before
        with pytest.raises(KeyError) as e:
            registry.get("no_such_name")
        assert str(e.value).startswith(f"{key}: unknown ") and repr(builtin) in str(e.value)


@pytest.mark.timeout(30)
def test_user_registered_advantage_passes_config_load_and_is_used():
    assert "test_sign_of_centred" in ADVANTAGES
    cfg = load(None, ["algorithm.advantage=test_sign_of_centred"])
    assert cfg.algorithm.advantage == "test_sign_of_centred"
    assert compute_advantages(cfg.algorithm.advantage, REWARDS, GROUPS) == [1.0, -1.0, 0.0, 0.0, 0.0]

    path = "tests.unit.core.user_advantage:doubled_centred"  # never registered: named by import path
    cfg = load(None, [f"algorithm.advantage={path}"])
    assert cfg.algorithm.advantage == path
    assert compute_advantages(path, REWARDS, GROUPS) == [2.0, -2.0, 0.0, 0.0, 0.0]


@pytest.mark.timeout(10)
def test_config_checks_names_against_the_registries():
    for name in [*ADVANTAGES, *TOKEN_LEVEL_ADVANTAGES]:
        assert AlgorithmConfig(advantage=name).advantage == name
    assert "gae" in TOKEN_LEVEL_ADVANTAGES  # the lead's token-level estimator: valid beside the registry
    for name in CORRECTIONS:
        assert AlgorithmConfig(correction=name).correction == name
    with pytest.raises(ConfigError) as e:
        AlgorithmConfig(advantage="nope")
    assert str(e.value) == f"algorithm.advantage: must be one of {[*ADVANTAGES.names(), *TOKEN_LEVEL_ADVANTAGES]}, got 'nope'"
    assert "test_sign_of_centred" in str(e.value)  # the user's entry is listed with the built-ins
    with pytest.raises(ConfigError, match=r"^algorithm\.advantage: cannot import 'tests\.no_such_module:fn' \(ModuleNotFoundError"):
        AlgorithmConfig(advantage="tests.no_such_module:fn")
    with pytest.raises(ConfigError, match=r"^algorithm\.advantage: advantage .* has no callable 'NOT_CALLABLE'"):
        AlgorithmConfig(advantage="tests.unit.core.user_advantage:NOT_CALLABLE")
    # losses and corrections take registered names only (their users look them up by name)
    with pytest.raises(ConfigError, match=r"^algorithm\.loss: must be one of \[.*'ppo_clip'.*\], got 'm:f'$"):
        AlgorithmConfig(loss="m:f")
    with pytest.raises(ConfigError, match=r"^algorithm\.correction: must be one of .*'tis'.*, got 'xis'$"):
        AlgorithmConfig(correction="xis")
