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


def default_tol(dtype: str) -> float:
    """`weights.parity_tol` when it is 0: what two correct engines of `model.dtype` differ by on
    the probe, with room (fp32: about 1e-6 measured between the trainer and both engines here;
    16-bit: rounding of every logit). A corrupted load is off by about 1 or more."""
    return 1e-2 if dtype == "float32" else 0.25


@dataclass
class ParityCheck:
    """The rule and its record; `FleetManager` drives it (see the module docstring)."""

    every: int
    """Check every this many publishes (the first one included); 0: never (syncs still are not)."""
    tol: float
    """Largest max-abs log-prob gap a server may show."""
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
    def from_config(cls, weights: Any, dtype: str, vocab_size: int | None) -> "ParityCheck | None":
        """From the `weights:` section (`parity_every`, `parity_tol`, `parity_action`); None when off
        (or with no vocabulary to draw the probe from: a model-less pipeline has nothing to compare)."""
        if weights.parity_every <= 0 or vocab_size is None:
            return None
        tol = weights.parity_tol if weights.parity_tol > 0 else default_tol(dtype)
        return cls(every=weights.parity_every, tol=tol, action=weights.parity_action, ids=probe_ids(vocab_size))

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
        if gap <= self.tol:
            return None
        self.failures += 1
        return (f"weights: server {name} serves version {version} with log-probs {gap:.4g} away from the trainer's "
                f"on the parity probe (weights.parity_tol={self.tol:g}): the weights it loaded are not the ones published")

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
