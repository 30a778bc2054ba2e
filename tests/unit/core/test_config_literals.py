"""String choices of the config tree are `Literal[...]` fields, checked in one place (`asyncrl.config.checks.check_literals`).

Through `load` OmegaConf rejects a value outside the choices first; its message is reworded so that either way the
user reads `<key>: must be one of [...], got '<value>'`, the message of `asyncrl.config.checks.one_of`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from asyncrl.config import Config, ConfigError, load
from asyncrl.config.checks import check_literals, literal_fields

CHOICE_KEYS = {
    "model.dtype", "data.task", "trainer.mode", "trainer.admission", "trainer.staleness_level", "trainer.lr_schedule",
    "trainer.device", "trainer.engine", "trainer.attn_implementation", "trainer.grad_reduce", "trainer.optimizer_impl",
    "trainer.proximal_forward", "algorithm.proximal", "algorithm.mis_level", "algorithm.loss_agg",
    "algorithm.kl_estimator", "algorithm.kl_ctrl.type", "rollout.external_weights",
    "rollout.update_mode", "rollout.placement_strategy", "rollout.dtype", "hardware",
}


def _literal_keys(cls: type = Config, prefix: str = "") -> dict[str, tuple[type, tuple[Any, ...]]]:
    """Dotted key -> (the dataclass that holds it, its choices), over the whole tree below `cls`."""
    out = {f"{prefix}{name}": (cls, choices) for name, choices in literal_fields(cls)}
    inst = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(getattr(inst, f.name)):
            out.update(_literal_keys(type(getattr(inst, f.name)), f"{prefix}{f.name}."))
    return out


LITERALS = _literal_keys()


@dataclass
class _Toy:
    kind: Literal["a", "b"] = "a"
    name: str = "free"  # a plain str: not a choice


def test_the_string_choices_are_the_literal_fields_and_registry_names_are_not():
    assert set(LITERALS) == CHOICE_KEYS
    for key, (cls, choices) in LITERALS.items():
        assert getattr(cls(), key.rpartition(".")[2]) in choices, key  # each default is one of its choices
    hints = {name for name, _ in literal_fields(type(Config().algorithm))}
    assert not hints & {"advantage", "loss", "correction"}  # registry-checked: a user-registered name is valid
    assert "backend" not in {name for name, _ in literal_fields(type(Config().rollout))}  # engines/registry.py's names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", sorted(CHOICE_KEYS))
def test_a_value_outside_the_choices_names_the_key_and_the_choices(key):
    cls, choices = LITERALS[key]
    want = f"{key}: must be one of {list(choices)}, got 'nope'"
    with pytest.raises(ConfigError) as loaded:
        load(None, [f"{key}=nope"])
    assert str(loaded.value) == want
    with pytest.raises(ConfigError) as built:  # the dataclass alone (as ray actors and tests build it) says the same
        cls(**{key.rpartition(".")[2]: "nope"})
    assert str(built.value) == want


@pytest.mark.timeout(30)
def test_yaml_and_non_string_values_get_the_same_message(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("rollout:\n  update_mode: sideways\n")
    with pytest.raises(ConfigError, match=r"^rollout\.update_mode: must be one of \['keep', 'wait', 'abort'\], got 'sideways'$"):
        load(p)
    # YAML reads these as int / bool / a quoted string; the message shows the value as text, as with a `str` field
    for value, shown in (("1", "'1'"), ("false", "'False'"), ("'it''s'", '"it\'s"')):
        with pytest.raises(ConfigError) as e:
            load(None, [f"algorithm.kl_estimator={value}"])
        assert str(e.value) == f"algorithm.kl_estimator: must be one of ['k1', 'k2', 'k3'], got {shown}"


@pytest.mark.timeout(30)
def test_every_choice_loads_as_a_plain_string():
    cfg = load(None, ["model.dtype=bfloat16", "trainer.lr_schedule=cosine", "rollout.update_mode=abort",
                      "rollout.placement_strategy=STRICT_SPREAD", "algorithm.kl_ctrl.type=adaptive"])
    got = (cfg.model.dtype, cfg.trainer.lr_schedule, cfg.rollout.update_mode, cfg.rollout.placement_strategy, cfg.algorithm.kl_ctrl.type)
    assert got == ("bfloat16", "cosine", "abort", "STRICT_SPREAD", "adaptive")
    assert all(type(v) is str for v in got)
    for key, (cls, choices) in LITERALS.items():  # each choice passes the one check (other rules aside)
        obj = cls()
        for choice in choices:
            setattr(obj, key.rpartition(".")[2], choice)
            check_literals(obj, key.rpartition(".")[0])


def test_check_literals_checks_only_literal_fields():
    check_literals(_Toy(name="anything"), "toy")
    with pytest.raises(ConfigError, match=r"^toy\.kind: must be one of \['a', 'b'\], got 'c'$"):
        check_literals(_Toy(kind="c"), "toy")  # type: ignore[arg-type]
    assert literal_fields(_Toy) == (("kind", ("a", "b")),)
