"""Loading, saving and documenting the config tree of `asyncrl.config`.

`load` merges the dataclass defaults, a YAML recipe and `key=value` overrides with
OmegaConf and turns the result back into dataclasses (their `__post_init__` checks run
there); every failure becomes a `ConfigError` that names the key (or, for a recipe that is
not valid YAML, the file and line). `document` reads the
docstring under each field for `asyncrl config --doc` and `configs/README.md`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence


def _translate(e: Exception) -> Any:
    from asyncrl.config import ConfigError

    key = getattr(e, "full_key", None)
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    return ConfigError(f"{key}: {msg}" if key else msg)


def load(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Any:
    """Defaults <- YAML recipe <- `key=value` overrides, validated; errors name the key."""
    from asyncrl.config import Config, ConfigError
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

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
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"override {o!r} must look like key=value")
        layers.append(_read_overrides(overrides))
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
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
    from asyncrl.config import ConfigError
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
    from asyncrl.config import ConfigError
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


def document(cls: type | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every field (of `Config` by default), read from the docstrings under the fields."""
    if cls is None:
        from asyncrl.config import Config

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
