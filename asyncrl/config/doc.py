"""Documenting the config tree: every key with its default and the docstring under its field, and
each policy loss's own settings (`algorithm.loss_args.<field>`), read from their dataclasses.

One docstring reader, `field_docs`, serves both tables. `page()` is what `asyncrl config --doc`
prints and what configs/README.md holds below its `GENERATED` line (`bash scripts/gen_config_doc.sh`
rewrites it; a test checks the two are equal). `asyncrl_keys()` is the set of keys `load` compares
an unknown key against.

Boundary: reads classes, never a config a user loaded; imports the tree (`tree`), not the loader (`io`),
which imports this module.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

from asyncrl.config.tree import Config

GENERATED = ("<!-- generated from the config dataclasses by `asyncrl config --doc` (bash scripts/gen_config_doc.sh): "
             "edit their docstrings, not the text below -->")
"""The line of configs/README.md after which `page()` follows; the prose above it is written by hand."""

LOSS_SETTINGS = """\
A policy loss's own constants are set as `algorithm.loss_args.<key>` (e.g. `algorithm.loss_args.clip_ratio_c=5`),
checked at load against the settings of the selected `algorithm.loss`: a key it does not have, or a bad value, is an
error naming the key. The older keys `algorithm.clip_ratio_c` and `algorithm.gspo_clip_ratio_low` / `_high` still set
the `ppo_clip` / `gspo` settings they name. A sequence-level loss (`gspo`) aggregates its policy term
`seq_mean_token_mean` whatever `algorithm.loss_agg` says. The table is written from each loss's settings dataclass
(`asyncrl/trainer/losses.py`).
"""
"""The prose above the table of `loss_settings_table`."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls`, whitespace folded: {field name: text}."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    return {a.target.id: " ".join(str(b.value.value).split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def document(cls: type = Config, prefix: str = "", inst: Any = None) -> list[tuple[str, str, str]]:
    """(key, default, doc) for every leaf field of `cls` (the whole tree by default), nested sections flattened.
    A section's defaults are those of the instance its parent makes (asyncrl's `queue` section sets some of
    `TransferQueueConfig`'s own: `run_id`, `inline_max_bytes`)."""
    docs, inst = field_docs(cls), cls() if inst is None else inst
    rows: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls):
        v = getattr(inst, f.name)
        if dataclasses.is_dataclass(v):
            rows += document(type(v), f"{prefix}{f.name}.", v)
        else:
            rows.append((f"{prefix}{f.name}", repr(v), docs.get(f.name, "")))
    return rows


@functools.lru_cache(maxsize=1)
def asyncrl_keys() -> frozenset[str]:
    """Every key of the config tree (what `asyncrl config --doc` lists)."""
    return frozenset(k for k, _, _ in document())


def key_table() -> str:
    """Markdown rows of every key: its default and its field's docstring."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key}` | `{default}` | {doc} |" for key, default, doc in document()]
    return "\n".join(rows) + "\n"


def loss_settings_table() -> str:
    """Markdown rows of every policy loss asyncrl ships: how its policy term is aggregated, and each setting
    (`algorithm.loss_args.<field>`) with its default and the docstring of its field."""
    from asyncrl.trainer.losses import POLICY_LOSSES  # torch: when the page is written, not when the config loads

    rows = ["| `algorithm.loss` | aggregated as | key | default | meaning |", "|---|---|---|---|---|"]
    for name in POLICY_LOSSES.names():
        entry = POLICY_LOSSES[name]
        if not entry.fn.__module__.startswith("asyncrl."):  # a user's loss documents itself
            continue
        agg = "`seq_mean_token_mean`, always" if entry.level == "sequence" else "`algorithm.loss_agg`"
        fields, docs, default = dataclasses.fields(entry.settings), field_docs(entry.settings), entry.settings()
        if not fields:
            rows.append(f"| `{name}` | {agg} | — | | no settings of its own |")
        for f in fields:
            rows.append(f"| `{name}` | {agg} | `algorithm.loss_args.{f.name}` | `{getattr(default, f.name)!r}` | {docs.get(f.name, '')} |")
    return "\n".join(rows) + "\n"


def page() -> str:
    """The generated part of configs/README.md, from the `GENERATED` line on: the policy losses' settings, then every key."""
    return (f"{GENERATED}\n\n## Policy loss settings\n\n{LOSS_SETTINGS}\n{loss_settings_table()}\n"
            f"## Every key\n\n{key_table()}")
