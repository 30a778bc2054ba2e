"""Loading and saving the config tree of `asyncrl.config` (documenting it: `asyncrl.config.doc`).

`load` merges the dataclass defaults, a YAML recipe and `key=value` overrides with
OmegaConf and turns the result back into dataclasses (their `__post_init__` checks run
there); every failure becomes a `ConfigError` that names the key (or, for a recipe that is
not valid YAML, the file and line). A mandatory key left at `???` (OmegaConf's MISSING) by the
recipe or an override is an error naming it (OmegaConf would keep the dataclass default under it);
an unknown key's error says what to set instead (`asyncrl.config.aliases`: verl's names, close
matches). A string-choice field is typed `Literal[...]`: OmegaConf (>= 2.4) rejects any other value while merging,
and its message is reworded as `checks.one_of`'s (what the dataclass's own check says when built directly).

Two presets are applied after the merge, before any check, each reported by `load_with_changes` (what
`asyncrl train` prints): a data path with no `data.task` set anywhere selects `data.task=jsonl` (a digit task
set together with a data path is an error, never a silently ignored file), and `hardware=cpu` moves every GPU
setting the recipe holds to its CPU counterpart (`cpu_preset`), below the command line's own keys.

The run's secret (`queue.secret`, `weights.secret`) is never written by this module: `dump_resolved`
records `<set>` in its place, a recipe that holds one must be readable by its owner only, and an
override (`queue.secret=...`, which every user of the host reads in /proc/<pid>/cmdline) is refused;
`run_secret` reads it from `ASYNCRL_SECRET` or from the 0600 file named by `ASYNCRL_SECRET_FILE`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Any, Sequence

from asyncrl.config.checks import ConfigError
from asyncrl.config.doc import asyncrl_keys
from asyncrl.config.tree import Config
from asyncrl.redis_url import REDACTED, redact_url, url_password

_NOT_A_CHOICE = re.compile(r"Invalid value '(.*)', expected one of (\[.*\])")
"""OmegaConf's message for a value outside a `Literal[...]` field's choices (the value as `str` gives it)."""


def _translate(e: Exception) -> Any:

    key = getattr(e, "full_key", None)
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    choice = _NOT_A_CHOICE.fullmatch(msg)
    if choice:  # worded as checks.one_of
        msg = f"must be one of {choice[2]}, got {choice[1]!r}"
    return ConfigError(f"{key}: {msg}" if key else msg)


def _flat(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of a plain (container) mapping."""
    if not isinstance(node, dict) or not node:
        return [prefix] if prefix else []
    return [k for name, v in node.items() for k in _flat(v, f"{prefix}.{name}" if prefix else str(name))]


def _unknown_key(e: Exception, named: list[tuple[str, Any]]) -> Any:
    """The `ConfigError` of an unknown key: the key as the user wrote it, where, and what to set instead."""
    from omegaconf import OmegaConf

    from asyncrl.config.aliases import hint  # not at the top: the package leaves it unloaded for `python -m asyncrl.config.aliases`

    top = str(getattr(e, "full_key", "") or "")
    known = asyncrl_keys()
    found: list[str] = []
    for where, layer in named:
        for key in _flat(OmegaConf.to_container(layer, resolve=False)):
            if any(key == k or key.startswith(k + ".") for k in known):
                continue
            h = hint(key, known)
            section = key.rpartition(".")[0]
            if not h:
                sections = sorted({k.partition(".")[0] for k in known if "." in k})
                h = (f"{section} has no such key" if any(k.startswith(section + ".") for k in known)
                     else f"the config has no section {key.partition('.')[0]!r} (sections: {', '.join(sections)})")
                h += "; every key: asyncrl config --doc"
            line = f"{key}: unknown key (in {where}); {h}"
            first = bool(top) and (key == top or key.startswith(top + "."))
            found.insert(0 if first else len(found), line)
    if not found:
        return None
    more = f" (and {len(found) - 1} more unknown: " + "; ".join(found[1:]) + ")" if found[1:] else ""
    return ConfigError(found[0] + more)


def _check_missing(named: list[tuple[str, Any]]) -> None:
    """A key left at `???` by a layer and set by no later layer: a `ConfigError` naming it and the layer."""
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

SECRET_KEYS = ("queue.secret", "weights.secret", "queue.record_key")
"""Where a run's secrets may sit in the tree (one secret for both planes, `launch.share_run_secret`; the Redis
records' key, `run_dir.assign_record_key`)."""
SECRET_SET = REDACTED
SECRET_LEAVES = {key.rsplit(".", 1)[1] for key in SECRET_KEYS}
"""The names those keys end in: `redacted` replaces a set value of any of them, wherever it sits."""
"""What `dump_resolved` writes for a secret that was set (read back by `load` as not set)."""


URL_KEYS = ("queue.redis_url",)
"""Keys whose value is a URL that may carry a password (`redis://:PASSWORD@host:port/0`): a secret too."""

REDIS_URL_HELP = ("put the URL in the environment, ASYNCRL_REDIS_URL='redis://:PASSWORD@host:6379/0', and pass "
                  "'queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}' (quoted: the shell leaves it to asyncrl), or set it "
                  "in a recipe of mode 0600")


def _check_secret_sources(path: Path | None, recipe: Any, overrides: Sequence[str]) -> None:
    """A secret on the command line or in a recipe other users can read is a `ConfigError`; the
    message never repeats the value."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip().lstrip("+~") in SECRET_KEYS and value.strip() not in ("", "''", '""', SECRET_SET):
            raise ConfigError(f"{key.strip()}: a secret is not taken on the command line (every user of this host "
                              "reads it in /proc/<pid>/cmdline); export ASYNCRL_SECRET, or ASYNCRL_SECRET_FILE=<a file of "
                              "mode 0600>")
        if key.strip().lstrip("+~") in URL_KEYS and url_password(value.strip().strip("'\"")):
            raise ConfigError(f"{key.strip()}: a URL with a password is not taken on the command line (every user of "
                              f"this host reads it in /proc/<pid>/cmdline); {REDIS_URL_HELP}")
    if path is not None:
        from omegaconf import OmegaConf

        st = os.stat(path)
        if st.st_mode & 0o077 and OmegaConf.is_dict(recipe):
            for key in SECRET_KEYS:
                value = OmegaConf.select(recipe, key, default="")
                if value not in ("", None, SECRET_SET):
                    raise ConfigError(f"{key}: set in {str(path)!r}, which other users can read (mode "
                                      f"{st.st_mode & 0o777:o}); chmod 600 it, or export ASYNCRL_SECRET / "
                                      "ASYNCRL_SECRET_FILE instead")
            for key in URL_KEYS:
                if url_password(OmegaConf.select(recipe, key, default="", throw_on_resolution_failure=False)):
                    raise ConfigError(f"{key}: a URL with a password in {str(path)!r}, which other users can read "
                                      f"(mode {st.st_mode & 0o777:o}); chmod 600 it, or {REDIS_URL_HELP}")


def run_secret(environ: Any = None) -> str:
    """The secret given to this process: `ASYNCRL_SECRET`, else the first line of the file named by
    `ASYNCRL_SECRET_FILE` (which must be a regular file of this user that no one else may read), else ''."""
    env = os.environ if environ is None else environ
    if env.get("ASYNCRL_SECRET"):
        return env["ASYNCRL_SECRET"]
    name = env.get("ASYNCRL_SECRET_FILE", "")
    if not name:
        return ""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"ASYNCRL_SECRET_FILE={name!r}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"ASYNCRL_SECRET_FILE={name!r}: must be a regular file of this user with mode 0600 "
                              f"(it is {st.st_mode & 0o777:o}, owner uid {st.st_uid})")
        secret = os.read(fd, 4096).decode(errors="replace").strip().splitlines()
    finally:
        os.close(fd)
    if not secret or not secret[0].strip():
        raise ConfigError(f"ASYNCRL_SECRET_FILE={name!r}: the file is empty")
    return secret[0].strip()


def redacted(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` (a `to_dict`) with every set secret replaced by `SECRET_SET`, and every URL's password."""
    out = {k: redacted(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for k, v in out.items():
        if k in SECRET_LEAVES and v:
            out[k] = SECRET_SET
        elif isinstance(v, str):
            out[k] = redact_url(v)
    return out


def load(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML recipe <- `key=value` overrides, validated; errors name the key."""
    return load_with_changes(path, overrides)[0]


def load_with_changes(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> tuple[Config, list[tuple[str, str, str]]]:
    """`load`, and the presets it applied: (key, value as written, why) each (`data.task` from a data path, `hardware=cpu`)."""
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
            _check_hydra_prefix(o)
            if "=" not in o:
                raise ConfigError(f"override {o!r} must look like key=value")
        _check_secret_sources(Path(path) if path is not None else None, layers[1] if path is not None else None, overrides)
        layers.append(_read_overrides(overrides))
        named.append(("the overrides", layers[-1]))
        _check_missing(named)
        merged = OmegaConf.merge(*layers)
        for key in SECRET_KEYS:  # a resolved config read back as a recipe: its secret is not known
            if OmegaConf.select(merged, key, default="") == SECRET_SET:
                OmegaConf.update(merged, key, "")
        changes = _presets(merged, named)
        for key, value, _ in changes:
            OmegaConf.update(merged, key, value, merge=False)
        cfg = OmegaConf.to_object(merged)
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise (_unknown_key(e, named) or _translate(e)) from None
    except OmegaConfBaseException as e:
        raise _translate(e) from None
    except ValueError as e:  # raised by a __post_init__ (already names its key)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(_with_fix(str(e))) from None
    assert isinstance(cfg, Config)
    return cfg, [(key, _show(value), why) for key, value, why in changes]


def _show(value: Any) -> str:
    return value if isinstance(value, str) else "[...]" if isinstance(value, list) else str(value).lower()


def _with_fix(msg: str) -> str:
    """A check of the planes' own configs (which know nothing of asyncrl's keys), with the fix a CPU machine needs."""
    if msg.startswith("weights.device must be cuda"):
        return msg + "; without a CUDA GPU use weights.device=cpu with weights.backend=shm (one host) or gloo, or hardware=cpu"
    return msg


def _check_hydra_prefix(override: str) -> None:
    """Hydra's `+key=` (add), `++key=` (force) and `~key` (delete) are not asyncrl syntax: one line saying what to write."""
    from asyncrl.config.aliases import hint  # as in _unknown_key

    key, _, value = override.partition("=")
    key = key.strip()
    if not key.startswith(("+", "~")):
        return
    bare = key.lstrip("+~")
    if key.startswith("~"):
        what = f"Hydra's ~ (delete a key) has no meaning here, every key has a default: drop the override, or set {bare}=<value>"
    else:
        what = f"drop the + (Hydra's add-a-key prefix; any asyncrl key is set with key=value): {bare}={value}"
    known = asyncrl_keys()
    if bare not in known and not any(bare.startswith(k + ".") for k in known):
        what += f"; {bare} itself is not an asyncrl key: {hint(bare, known) or 'every key: asyncrl config --doc'}"
    raise ConfigError(f"{key}: {what}")


CPU_PRESET_DTYPES = ("bfloat16", "float16")
"""`model.dtype` values `hardware=cpu` turns into float32."""


def _given(named: list[tuple[str, Any]], key: str, only: str | None = None) -> bool:
    """Whether a user layer (`only`: that one, e.g. "the overrides") sets `key`."""
    from omegaconf import OmegaConf

    return any(OmegaConf.select(layer, key, default=_ABSENT) is not _ABSENT
               for where, layer in named if only is None or where == only)


def _presets(merged: Any, named: list[tuple[str, Any]]) -> list[tuple[str, Any, str]]:
    """(key, value, why) of each preset to apply to the merged tree: the data task a data path selects,
    and `hardware=cpu`'s CPU counterparts of GPU settings (`cpu_preset`; a key the overrides set is left alone)."""
    from omegaconf import OmegaConf

    out: list[tuple[str, Any, str]] = []
    paths = [k for k in ("data.train_path", "data.eval_path") if OmegaConf.select(merged, k) and _given(named, k)]
    if paths and merged.data.task != "jsonl":
        if _given(named, "data.task"):
            raise ConfigError(f"{paths[0]}: given, but data.task={merged.data.task} is a built-in task that reads no "
                              f"file; set data.task=jsonl to train on the file, or drop {paths[0]} for the built-in task")
        out.append(("data.task", "jsonl", f"selected by {paths[0]}"))
    if OmegaConf.select(merged, "hardware") == "cpu":
        user = [k for k, _, _ in out]
        out += [(k, v, why) for k, v, why in cpu_preset(merged) if k not in user and not _given(named, k, "the overrides")]
    return out


def cpu_preset(merged: Any) -> list[tuple[str, Any, str]]:
    """What `hardware=cpu` changes in the merged tree `merged`: (key, CPU value, why) of each GPU setting it holds."""
    from omegaconf import OmegaConf

    t, r, w, m = merged.trainer, merged.rollout, merged.weights, merged.model
    why = "hardware=cpu"
    out: list[tuple[str, Any, str]] = []
    if t.device != "cpu":
        out.append(("trainer.device", "cpu", why))
    if str(w.device).startswith("cuda"):
        out.append(("weights.device", "cpu", why))
    if w.backend in ("nccl", "cuda_ipc"):
        out.append(("weights.backend", "gloo" if merged.ray.enabled and merged.ray.address else "shm", why))
    if m.dtype in CPU_PRESET_DTYPES:
        out.append(("model.dtype", "float32", why))
    for key, gpu, cpu in (("gpu_bundles", True, False), ("backend", "vllm", "torch"), ("enforce_eager", False, True)):
        if r[key] == gpu:
            out.append((f"rollout.{key}", cpu, why))
    if r.tensor_parallel_size > 1:
        out.append(("rollout.tensor_parallel_size", 1, why))
    fleets = OmegaConf.to_container(r.fleets, resolve=True)
    cpu_fleets = [{**f, **{k: v for k, v in (("gpu_bundles", False), ("tensor_parallel_size", 1)) if k in f},
                   **({"backend": "torch"} if f.get("backend") == "vllm" else {})} for f in fleets]
    if cpu_fleets != fleets:
        out.append(("rollout.fleets", cpu_fleets, why + " (each fleet)"))
    return out


def _read_yaml(p: Path) -> Any:
    """The recipe at `p`; a YAML syntax error is a `ConfigError` naming the file and line."""
    import yaml
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


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config tree as plain nested dicts."""
    return dataclasses.asdict(cfg)


def dump_resolved(cfg: Config, path: str | os.PathLike) -> None:
    """Write the full resolved config as YAML (what this run used, every key; a secret as `<set>`)."""
    from omegaconf import OmegaConf

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(redacted(to_dict(cfg))), path)
