"""What the simulator needs to know about the hardware and the workload: `Costs`, and the GPU `Profile`.

`Costs` are the same quantities as `asyncrl.bench.pipeline.Load` (servers x max_concurrency slots,
`token_cost_s` per token of a running request (plus `token_cost_slope_s` per request in flight on
its server), `LongTail` response lengths, trainer tokens/s,
publish seconds), plus the fixed latencies a measured run adds (per request, per trainer step).
`Profile` is a public GPU configuration read from `asyncrl/plan/profiles/NAME.yaml`: per-GPU costs
and a workload, each number with its source, which `Profile.costs(rollout_gpus, trainer_gpus)`
turns into `Costs` for one split, adding what grows with the cluster (`scale.Scaling`: the weight
broadcast with the servers, the gradient all-reduce with the trainer's ranks). It does not know about modes or admission (see `sim.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from asyncrl.plan.scale import Scaling
from asyncrl.rollout.cost_model import LongTail

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass
class Costs:
    servers: int
    max_concurrency: int
    """Requests one server runs at once; more wait in its queue."""
    token_cost_s: float
    """Seconds per generated token of one running request (the base: see `token_cost_at`)."""
    lengths: LongTail
    trainer_tokens_per_s: float
    """Loss tokens per second of the whole trainer pool."""
    groups: int
    """Groups per trainer step (trainer.prompts_per_step)."""
    group_size: int
    publish_s: float = 0.0
    """Seconds a publish takes; every server is paused (update_mode=keep) meanwhile."""
    step_overhead_s: float = 0.0
    """Fixed trainer seconds per step beyond its tokens (batch plan, queue get, ack)."""
    request_overhead_s: float = 0.0
    """Fixed seconds per sample beyond its tokens (routing, reward, queue put: the queue latency)."""
    length_seed: int | None = None
    """Draw lengths as `CostModelServer(seed=length_seed + i)` does (server i's j-th request), so a
    simulation of a bench run sees the same long samples it did; None: one seeded stream."""
    requests_before: int = 0
    """With `length_seed`: requests server 0 served before the first rollout (the pipeline's step-0
    evaluation, one per eval sample, goes to the first server of an idle fleet). Each used up one of
    its draws, so without them every later long sample of server 0 lands one request early."""

    contention: float = 1.0
    """While the trainer trains and a server generates, each runs this many times slower (>= 1;
    1: they share nothing). `demo.py` fits it on a calibration run where they overlap."""

    token_cost_slope_s: float = 0.0
    """Seconds per token each request in flight on the same server adds to a request's token (a
    batched engine: a decode step grows with its batch). 0: the cost does not depend on concurrency
    (the cost-model bench, the GPU profiles). `demo.py` fits it from an engine sweep."""

    def __post_init__(self) -> None:
        if self.token_cost_slope_s < 0:
            raise ValueError(f"costs.token_cost_slope_s must be >= 0 (0: no concurrency dependence), got {self.token_cost_slope_s}")
        if self.contention < 1:
            raise ValueError(f"costs.contention must be >= 1 (1: no contention), got {self.contention}")
        for key in ("servers", "max_concurrency", "groups", "group_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"costs.{key} must be >= 1, got {getattr(self, key)}")
        if self.token_cost_s <= 0 or self.trainer_tokens_per_s <= 0:
            raise ValueError(f"costs.token_cost_s and costs.trainer_tokens_per_s must be > 0, got {self.token_cost_s}, {self.trainer_tokens_per_s}")

    def token_cost_at(self, active: int) -> float:
        """Seconds per generated token of a request while `active` requests run on its server:
        `token_cost_s + token_cost_slope_s x active`."""
        return self.token_cost_s + self.token_cost_slope_s * active

    @property
    def rollout_capacity(self) -> float:
        """Generated tokens/s of the fleet with every slot busy."""
        return self.servers * self.max_concurrency / self.token_cost_at(self.max_concurrency)

    @property
    def bound(self) -> float:
        return min(self.rollout_capacity, self.trainer_tokens_per_s)

    def slice_factor(self, max_groups: int) -> int:
        """The smallest f dividing both `servers` and `groups` with `groups / f <= max_groups` (else the
        largest f dividing both): the fleet is homogeneous and the batch grows with it, so 1/f of the
        servers, of the groups and of the trainer pool run the same steps as the whole, at 1/f of its
        tokens/s."""
        if self.groups <= max_groups:
            return 1
        g = math.gcd(self.servers, self.groups)
        divisors = [f for f in range(1, g + 1) if g % f == 0]
        return min((f for f in divisors if self.groups / f <= max_groups), default=divisors[-1])

    def sliced(self, f: int) -> "Costs":
        """1/f of the run (see `slice_factor`); per-step and per-request costs are unchanged."""
        if f == 1:
            return self
        if self.servers % f or self.groups % f:
            raise ValueError(f"costs.servers {self.servers} and costs.groups {self.groups} must both divide by the slice {f}")
        return replace(self, servers=self.servers // f, groups=self.groups // f, trainer_tokens_per_s=self.trainer_tokens_per_s / f)

    @classmethod
    def from_load(cls, load: Any, *, publish_s: float = 0.01, step_overhead_s: float = 0.0, request_overhead_s: float = 0.0,
                  length_seed: int | None = None, requests_before: int = 0) -> "Costs":
        """The costs of an `asyncrl bench pipeline` load (`--profile-from-bench`): the same parameters the bench sleeps for."""
        return cls(servers=load.servers, max_concurrency=load.max_concurrency, token_cost_s=load.token_cost_s, lengths=load.lengths,
                   trainer_tokens_per_s=load.trainer_capacity, groups=load.groups, group_size=load.group_size,
                   publish_s=publish_s, step_overhead_s=step_overhead_s, request_overhead_s=request_overhead_s,
                   length_seed=length_seed, requests_before=requests_before)


@dataclass
class Reference:
    """A published measurement to set a prediction beside."""

    gpus: int
    rollout_gpus: int
    trainer_gpus: int
    speedup_vs_sync: float
    source: str
    sync_step_s: float | None = None
    async_step_s: float | None = None
    actor_update_s: float | None = None


@dataclass
class Profile:
    """A GPU configuration: per-GPU costs and a workload (`profiles/*.yaml`; every number carries its source there)."""

    name: str
    gpus_per_server: int
    """GPUs of one rollout server (tensor parallel size)."""
    max_concurrency: int
    """Requests one server runs at once."""
    token_cost_s: float
    trainer_tokens_per_s_per_gpu: float
    lengths: LongTail
    groups: int
    """Groups per trainer step at `base_gpus` (weak scaling: the batch grows with the GPUs)."""
    group_size: int
    base_gpus: int
    eta: int
    publish_every: int = 1
    publish_s: float = 0.0
    """Fixed seconds of a publish (pause, load, drop the KV cache); `scaling` adds the broadcast."""
    colocated_switch_s: float = 0.0
    """Colocated sync only: seconds per step to switch the GPUs between generation and training."""
    split_step: int = 8
    """Splits are searched in multiples of this many GPUs (a node)."""
    reference: Reference | None = None
    scaling: Scaling = field(default_factory=Scaling)
    """What grows with the cluster: the weight broadcast to the servers, the trainer's gradient collectives."""
    sources: dict[str, str] = field(default_factory=dict)

    def batch_groups(self, gpus: int) -> int:
        return max(1, round(self.groups * gpus / self.base_gpus))

    def costs(self, rollout_gpus: int, trainer_gpus: int, *, batch_gpus: int | None = None) -> Costs:
        """Costs of a split; `batch_gpus` (default: their sum) sets the batch under weak scaling.
        A publish broadcasts to every server (`Scaling.publish_s`); every step all-reduces the
        gradients over the trainer's ranks (`Scaling.collective_s`, as the step's overhead)."""
        if rollout_gpus < self.gpus_per_server or trainer_gpus < 1:
            raise ValueError(f"split {rollout_gpus}:{trainer_gpus}: needs >= {self.gpus_per_server} rollout GPUs (gpus_per_server) and >= 1 trainer GPU")
        servers = rollout_gpus // self.gpus_per_server
        return Costs(servers=servers, max_concurrency=self.max_concurrency, token_cost_s=self.token_cost_s,
                     lengths=self.lengths, trainer_tokens_per_s=trainer_gpus * self.trainer_tokens_per_s_per_gpu,
                     groups=self.batch_groups(batch_gpus or rollout_gpus + trainer_gpus), group_size=self.group_size,
                     publish_s=self.publish_s + self.scaling.publish_s(servers), step_overhead_s=self.scaling.collective_s(trainer_gpus))

    def colocated(self, gpus: int) -> Costs:
        """Colocated sync: every GPU generates, then every GPU trains (the baseline of `speedup_vs_sync`).
        Its weights move within each GPU (resharding, no broadcast over the network), so its publish
        is the fixed part plus the switch; its training all-reduces over all `gpus` ranks."""
        c = self.costs(gpus, gpus, batch_gpus=gpus)
        c.publish_s = self.publish_s + self.colocated_switch_s
        return c


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (`asyncrl/plan/profiles/NAME.yaml`) or path; errors name the file and the key."""
    import yaml

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ValueError(f"--profile {name_or_path!r}: no such profile (known: {known})")
    raw = yaml.safe_load(path.read_text())
    names = {f.name for f in fields(Profile)}
    unknown = set(raw) - names
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    raw = dict(raw)
    raw["lengths"] = LongTail(**raw["lengths"])
    try:
        if raw.get("reference") is not None:
            raw["reference"] = Reference(**raw["reference"])
        if raw.get("scaling") is not None:
            raw["scaling"] = Scaling(**raw["scaling"])
        return Profile(**raw)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
