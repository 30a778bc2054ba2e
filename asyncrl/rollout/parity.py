"""The weight-parity rule: after a publish, every server must score like the trainer.

Job: decide when a loaded version is checked (`weights.parity_every`), what it is checked on
(a fixed probe sequence), how far a server may be from the trainer (`weights.parity_tol`) and
what a gap above it means (`weights.parity_action`). A weight plane that delivers the wrong
bytes (a bucket built from a reused buffer, a tied head left stale, a dtype mix-up) produces
a server that generates plausibly and trains the policy against a different one; nothing else
in a run notices. The probe is one teacher-forced forward on each side: the trainer's
log-probs of the probe's tokens with the weights it just published, against each server's.

Boundary: pure decisions and arithmetic; the `FleetManager` asks servers and the trainer for
their scores and acts on the verdict (stop the run, or re-sync the server and re-send the
version), after the publish returned (`FleetWeights._settle`: no train step waits for it).

Trace (parity_every 2, tol 0.01, action stop):
    publish v0  -> due; returns; trainer and servers score the probe; main-0 gap 3e-7, main-1 gap 2e-7 -> ok
    publish v1  -> not due (every 2nd publish), nothing scored
    publish v2  -> due; returns; step 3 trains; main-1 gap 0.93 > 0.01 -> WeightParityError("... main-1 ... version 2 ... 0.93 ...")
    a restarted server's sync -> always checked, before it is routed (one server, rare)
With action `resync`, main-1 is taken out of routing and re-synced (the version is sent again);
a re-sync that still fails the probe restarts the server, and a restart that fails it stops the run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

PROBE_TOKENS = 64
"""Length of the probe sequence (its last 63 tokens are scored): a prefill, cheap at any model size."""
PROBE_ID_LIMIT = 4096
"""Probe ids are drawn below this (and below the tokenizer's size): ids every engine accepts."""
PROBE_SEED = 20260
"""Fixed: the probe is the same at every publish and in every run."""


class WeightParityError(RuntimeError):
    """A server scores the probe far from the trainer: the weights it loaded are not the trainer's.
    The run stops on purpose with this one line (`asyncrl: stopped: ...`)."""


def probe_ids(vocab_size: int, length: int = PROBE_TOKENS, seed: int = PROBE_SEED) -> list[int]:
    """The probe sequence: `length` token ids below min(vocab_size, PROBE_ID_LIMIT), fixed by `seed`.

    >>> probe_ids(10, 5)
    [6, 4, 1, 5, 2]
    """
    if vocab_size < 2:
        raise ValueError(f"parity probe: vocabulary of {vocab_size} tokens")
    rng = random.Random(seed)
    top = min(vocab_size, PROBE_ID_LIMIT)
    return [rng.randrange(top) for _ in range(length)]


def vocab_bound(tokenizer: Any, model_path: str) -> int | None:
    """The ids the probe may use: the tokenizer's size (engines refuse ids it does not know), else
    the model config's `vocab_size`; None without either (a benchmark's model-less pipeline)."""
    if tokenizer is not None:
        return len(tokenizer)
    import json
    from pathlib import Path

    config = Path(model_path or "-") / "config.json"
    return int(json.loads(config.read_text())["vocab_size"]) if config.is_file() else None


def max_abs_gap(reference: list[float], scored: list[float]) -> float:
    """Largest |reference - scored| over the probe's tokens; inf when they do not line up or a value
    is not finite (a server that returns junk fails the check instead of passing it).

    >>> max_abs_gap([-1.0, -2.0], [-1.0, -2.5])
    0.5
    >>> max_abs_gap([-1.0], [float("nan")])
    inf
    """
    if len(reference) != len(scored) or not reference:
        return math.inf
    gap = 0.0
    for a, b in zip(reference, scored):
        d = abs(float(a) - float(b))
        if not math.isfinite(d):
            return math.inf
        gap = max(gap, d)
    return gap


REL_TOL_16BIT = 2.0**-6
"""The relative part of the 16-bit default: per unit of |log-prob|, four bfloat16 epsilons (2^-8)."""


def default_tol(dtype: str, *rollout_dtypes: str) -> tuple[float, float]:
    """(`tol`, `rel_tol`) when `weights.parity_tol` is 0: what two correct engines differ by on the probe,
    with room, set by the least precise of the trainer's `model.dtype` and the servers' `rollout.dtype`s
    (empty: `model.dtype`). A token passes when |gap| <= tol + rel_tol * |trainer's log-prob|.
    Both float32: 0.01 (about 1e-6 measured between the trainer and both engines here), no relative part.
    Either side 16-bit: 0.25 plus 2^-6 of |log-prob|. Rounding error is relative: the log-prob of an
    unlikely token (-10, -20) is the difference of logits that large, rounded to 8 significant bits
    layer after layer on the 16-bit side, whether the other side rounds too or not. A bfloat16 engine
    against a float32 trainer, measured on the demo model: 0.004 untrained; after 60 steps up to 0.08,
    1.1% of |log-prob| (and 0.27 once, at version 50 of a bench run: over a flat 0.25). A corrupted
    load measured there: o_proj noise 0.66 untrained, 7.6 trained; two layers' down_proj swapped 0.34
    and 6.4; one stale v_proj 0.86 (0.26 to 7.4 above the relative part: all caught).

    >>> default_tol("float32"), default_tol("float32", ""), default_tol("float32", "bfloat16"), default_tol("bfloat16")
    ((0.01, 0.0), (0.01, 0.0), (0.25, 0.015625), (0.25, 0.015625))
    """
    if {dtype, *(d for d in rollout_dtypes if d)} == {"float32"}:
        return 1e-2, 0.0
    return 0.25, REL_TOL_16BIT


def rollout_dtypes(rollout: Any) -> list[str]:
    """The `rollout.dtype` of every fleet (`main`'s, then each `rollout.fleets` entry's, inheriting it)."""
    return [rollout.dtype, *(f.get("dtype", rollout.dtype) for f in rollout.fleets)]


@dataclass
class ParityCheck:
    """The rule and its record; `FleetManager` drives it (see the module docstring)."""

    every: int
    """Check every this many publishes (the first one included); 0: never (syncs still are not)."""
    tol: float
    """Largest log-prob gap a server may show on a token (beside `rel_tol`'s part)."""
    rel_tol: float = 0.0
    """Added allowance per unit of the trainer's |log-prob| on a token (16-bit rounding is relative)."""
    action: str = "stop"
    """`stop`: raise `WeightParityError`; `resync`: re-sync the server (then restart it, then stop)."""
    ids: list[int] = field(default_factory=list)
    """The probe sequence (`probe_ids`)."""
    publishes: int = 0
    gaps: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Server name -> (version, gap) of its last check (None-scoring servers are absent)."""
    failures: int = 0
    """Checks above `tol` so far (each one a stop or a re-sync)."""
    trainer_s: float = 0.0
    """Seconds the trainer's reference forward took at the last check (`weights/parity_trainer_s`)."""
    servers_s: float = 0.0
    """Seconds the servers took to score the probe at the last check (`weights/parity_servers_s`)."""
    ended: int = 0
    """Checks that ended (each after its publish returned; a re-sync's are not counted)."""

    @classmethod
    def from_config(cls, weights: Any, dtype: str, vocab_size: int | None, rollout: Any = None) -> "ParityCheck | None":
        """From the `weights:` section (`parity_every`, `parity_tol`, `parity_action`), `model.dtype` and
        the `rollout:` section (its fleets' dtypes: None, all `model.dtype`); None when off (or with no
        vocabulary to draw the probe from: a model-less pipeline has nothing to compare)."""
        if weights.parity_every <= 0 or vocab_size is None:
            return None
        tol, rel = (weights.parity_tol, 0.0) if weights.parity_tol > 0 else default_tol(dtype, *(rollout_dtypes(rollout) if rollout else ()))
        return cls(every=weights.parity_every, tol=tol, rel_tol=rel, action=weights.parity_action, ids=probe_ids(vocab_size))

    def due(self) -> bool:
        """Count one publish; whether it is checked."""
        self.publishes += 1
        return (self.publishes - 1) % self.every == 0

    def judge(self, name: str, version: int, reference: list[float], scored: list[float] | None) -> str | None:
        """Record `name`'s gap at `version`; returns the one-line verdict when it is above `tol`
        (None when it passes, or when the server cannot score: then nothing is recorded)."""
        if scored is None:
            return None
        gap = max_abs_gap(reference, scored)
        self.gaps[name] = (version, gap)
        excess = gap if not self.rel_tol or math.isinf(gap) else max(
            abs(float(a) - float(b)) - self.rel_tol * abs(float(a)) for a, b in zip(reference, scored))
        if excess <= self.tol:
            return None
        self.failures += 1
        rel = f" + {self.rel_tol:g} x |log-prob|, by dtype" if self.rel_tol else ""
        return (f"weights: server {name} serves version {version} with log-probs {gap:.4g} away from the trainer's "
                f"on the parity probe (weights.parity_tol={self.tol:g}{rel}): the weights it loaded are not the ones published")

    def max_gap(self) -> float:
        """The largest gap of the servers' last checks (0 when none was checked)."""
        return max((g for _, g in self.gaps.values()), default=0.0)

    def metrics(self) -> dict[str, float]:
        """`weights/parity_max_abs` (over servers), `weights/parity_max_abs/<server>`, the newest version
        checked (`weights/parity_version`: checks end after their publish) and what the last check cost."""
        out = {"weights/parity_trainer_s": self.trainer_s, "weights/parity_servers_s": self.servers_s} if self.ended else {}
        if not self.gaps:  # no server could score (a benchmark's cost-model servers): nothing compared
            return out
        out.update({"weights/parity_max_abs": self.max_gap(), "weights/parity_version": float(max(v for v, _ in self.gaps.values()))})
        out.update({f"weights/parity_max_abs/{name}": gap for name, (_, gap) in sorted(self.gaps.items())})
        return out
