"""Loading, saving and documenting the config tree of `asyncrl.config`.

`load` merges the dataclass defaults, a YAML recipe and `key=value` overrides with
OmegaConf and turns the result back into dataclasses (their `__post_init__` checks run
there); every failure becomes a `ConfigError` that names the key (or, for a recipe that is
not valid YAML, the file and line). A mandatory key left at `???` (OmegaConf's MISSING) by the
recipe or an override is an error naming it (OmegaConf would keep the dataclass default under it);
an unknown key's error says what to set instead (`asyncrl.config_aliases`: verl's names, close
matches). A string-choice field is typed `Literal[...]`: OmegaConf (>= 2.4) rejects any other value while merging,
and its message is reworded as `config_checks.one_of`'s (what the dataclass's own check says when built directly).
`document` reads the docstring under each field for `asyncrl config --doc` and `configs/README.md`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any, Sequence


_NOT_A_CHOICE = re.compile(r"Invalid value '(.*)', expected one of (\[.*\])")
"""OmegaConf's message for a value outside a `Literal[...]` field's choices (the value as `str` gives it)."""


def _translate(e: Exception) -> Any:
    from asyncrl.config_checks import ConfigError

    key = getattr(e, "full_key", None)
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    choice = _NOT_A_CHOICE.fullmatch(msg)
    if choice:  # worded as config_checks.one_of
        msg = f"must be one of {choice[2]}, got {choice[1]!r}"
    return ConfigError(f"{key}: {msg}" if key else msg)


def _flat(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of a plain (container) mapping."""
    if not isinstance(node, dict) or not node:
        return [prefix] if prefix else []
    return [k for name, v in node.items() for k in _flat(v, f"{prefix}.{name}" if prefix else str(name))]


def _unknown_key(e: Exception, named: list[tuple[str, Any]]) -> Any:
    """The `ConfigError` of an unknown key: the key as the user wrote it, where, and what to set instead."""
    from asyncrl.config_checks import ConfigError
    from asyncrl.config_aliases import hint
    from omegaconf import OmegaConf

    top = str(getattr(e, "full_key", "") or "")
    known = asyncrl_keys()
    for where, layer in named:
        for key in _flat(OmegaConf.to_container(layer, resolve=False)):
            if top and key != top and not key.startswith(top + "."):
                continue
            if any(key == k or key.startswith(k + ".") for k in known):
                continue
            h = hint(key, known)
            section = key.rpartition(".")[0]
            if not h:
                sections = sorted({k.partition(".")[0] for k in known if "." in k})
                h = (f"{section} has no such key" if any(k.startswith(section + ".") for k in known)
                     else f"the config has no section {key.partition('.')[0]!r} (sections: {', '.join(sections)})")
                h += "; every key: asyncrl config --doc"
            return ConfigError(f"{key}: unknown key (in {where}); {h}")
    return None


def _check_missing(named: list[tuple[str, Any]]) -> None:
    """A key left at `???` by a layer and set by no later layer: a `ConfigError` naming it and the layer."""
    from asyncrl.config_checks import ConfigError
    from omegaconf import OmegaConf

    unset: list[tuple[str, str]] = []
    for i, (where, layer) in enumerate(named):
        missing = OmegaConf.missing_keys(layer)
        for key in [k for k in _flat(OmegaConf.to_container(layer, resolve=False)) if k in missing]:
            later = [lay for _, lay in named[i + 1:] if key not in OmegaConf.missing_keys(lay)
                     and OmegaConf.select(lay, key, default=_ABSENT) is not _ABSENT]
            if not later and key not in (k for k, _ in unset):
                unset.append((key, where))
    if unset:
        key, where = unset[0]
        more = f" (also not set: {', '.join(k for k, _ in unset[1:])})" if len(unset) > 1 else ""
        by = "" if where == "the overrides" else f" by {where}"
        raise ConfigError(f"{key}: required{by}, not set; give it as {key}=...{more}")


_ABSENT = object()


def load(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Any:
    """Defaults <- YAML recipe <- `key=value` overrides, validated; errors name the key."""
    from asyncrl.config_checks import ConfigError
    from asyncrl.config_tree import Config
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    named: list[tuple[str, Any]] = []  # (where it comes from, layer) of what the user gave
    try:
        base = OmegaConf.structured(Config)
        layers = [base]
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {str(path)!r} not found")
            y = _read_yaml(p)
            if y is not None and not isinstance(y, dict) and not OmegaConf.is_dict(y):
                raise ConfigError(f"config file {str(path)!r} must hold a mapping")
            layers.append(y)
            if OmegaConf.is_dict(y):
                named.append((str(path), y))
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"override {o!r} must look like key=value")
        layers.append(_read_overrides(overrides))
        named.append(("the overrides", layers[-1]))
        _check_missing(named)
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise (_unknown_key(e, named) or _translate(e)) from None
    except OmegaConfBaseException as e:
        raise _translate(e) from None
    except ValueError as e:  # raised by a __post_init__ (already names its key)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None
    assert isinstance(cfg, Config)
    return cfg


def _read_yaml(p: Path) -> Any:
    """The recipe at `p`; a YAML syntax error is a `ConfigError` naming the file and line."""
    import yaml
    from asyncrl.config_checks import ConfigError
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(p)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(e.problem or e.context or "invalid YAML").split())
        raise ConfigError(f"config file {str(p)!r}{where}: YAML syntax error: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r}: YAML error: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r}: cannot read it ({e.strerror or e})") from None


def _read_overrides(overrides: Sequence[str]) -> Any:
    """`key=value` overrides; a value that is not valid YAML is a `ConfigError` naming the override."""
    import yaml
    from asyncrl.config_checks import ConfigError
    from omegaconf import OmegaConf

    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError as e0:
        for o in overrides:  # find the culprit
            try:
                yaml.safe_load(o.partition("=")[2])
            except yaml.YAMLError as e:
                what = " ".join(str(getattr(e, "problem", None) or "invalid YAML").split())
                raise ConfigError(f"{o.partition('=')[0]}: override {o!r} is not valid YAML: {what}") from None
        raise ConfigError(f"overrides {list(overrides)}: not valid YAML: {' '.join(str(e0).split())}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_resolved(cfg: Any, path: str | os.PathLike) -> None:
    """Write the full resolved config as YAML (what this run used, every key)."""
    from omegaconf import OmegaConf

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(to_dict(cfg)), path)


@functools.lru_cache(maxsize=1)
def asyncrl_keys() -> frozenset[str]:
    """Every key of the config tree (what `asyncrl config --doc` lists)."""
    return frozenset(k for k, _, _ in document())


def document(cls: type | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every field (of `Config` by default), read from the docstrings under the fields."""
    if cls is None:
        from asyncrl.config_tree import Config

        cls = Config
    import ast
    import inspect

    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())  # type: ignore[union-attr]
    rows: list[tuple[str, str, str]] = []
    inst = cls()
    for f in dataclasses.fields(cls):
        v = getattr(inst, f.name)
        if dataclasses.is_dataclass(v):
            rows += document(type(v), f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", repr(v), docs.get(f.name, "")))
    return rows
