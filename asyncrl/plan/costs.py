"""What the simulator needs to know about the hardware and the workload: `Costs`, and the GPU `Profile`.

`Costs` are the same quantities as `asyncrl.bench.pipeline.Load` (servers x max_concurrency slots,
`token_cost_s` per token of a running request (plus `token_cost_slope_s` per request in flight on
its server), `LongTail` response lengths, trainer tokens/s,
publish seconds), plus the fixed latencies a measured run adds (per request, per trainer step).
`Profile` is a public GPU configuration read from `asyncrl/plan/profiles/NAME.yaml`: per-GPU costs,
a workload and the schedule of the run it describes (eta, publish_every, update mode, staleness
level, admission), each number with its source, which `Profile.costs(rollout_gpus, trainer_gpus)`
turns into `Costs` for one split, adding what grows with the cluster (`scale.Scaling`: the weight
broadcast with the rollout GPUs, the gradient all-reduce with the trainer's ranks), and
`Profile.colocated(gpus)` into the colocated sync baseline. It does not simulate (see `sim.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from asyncrl.plan.scale import Scaling
from asyncrl.plan.schedule import STALENESS_LEVELS, UPDATE_MODES
from asyncrl.engines.cost_model import LongTail

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
    """Loss tokens per second of the whole trainer (all its ranks)."""
    groups: int
    """Groups per trainer step (trainer.prompts_per_step)."""
    group_size: int
    publish_s: float = 0.0
    """Seconds a publish takes; every server is paused meanwhile (`Schedule.update_mode`: what happens to its samples)."""
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

    prefill_token_cost_s: float = 0.0
    """Seconds one server takes per context token to prefill again the samples it was running when
    a publish with `update_mode=abort` aborted them (the weight update drops their KV cache).
    0: free (`keep` and `wait` never pay it)."""
    prompt_tokens: int = 0
    """Prompt tokens of a sample: part of the context an `abort` publish makes a server prefill again."""

    def __post_init__(self) -> None:
        if self.prefill_token_cost_s < 0 or self.prompt_tokens < 0:
            raise ValueError(f"costs.prefill_token_cost_s and costs.prompt_tokens must be >= 0, got {self.prefill_token_cost_s}, {self.prompt_tokens}")
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
        servers, of the groups and of the trainer's ranks run the same steps as the whole, at 1/f of its
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
    """Colocated sync: seconds per step (one published version)."""
    async_step_s: float | None = None
    """The split run: seconds per published version (`publish_every` trainer steps)."""
    actor_update_s: float | None = None
    """The split run's trainer: seconds updating the actor per published version."""
    sync_gen_s: float | None = None
    """Colocated sync: seconds generating per step."""
    sync_old_log_prob_s: float | None = None
    """Colocated sync: seconds recomputing the behaviour log-probs per step."""
    sync_actor_update_s: float | None = None
    """Colocated sync: seconds updating the actor per step."""


@dataclass
class Profile:
    """A GPU configuration: per-GPU costs and a workload (`profiles/*.yaml`; every number carries its source there)."""

    name: str
    gpus_per_server: int
    """GPUs of one rollout server (tensor parallel size)."""
    max_concurrency: int
    """Requests one server runs at once."""
    token_cost_s: float
    """Seconds per token of a request running alone on its server (see `token_cost_slope_s`)."""
    trainer_tokens_per_s_per_gpu: float
    lengths: LongTail
    groups: int
    """Groups per trainer step at `base_gpus` (weak scaling: the batch grows with the GPUs)."""
    group_size: int
    base_gpus: int
    eta: int
    publish_every: int = 1
    publish_s: float = 0.0
    """Fixed seconds of a publish (gather the weights, load, drop the KV cache); `scaling` adds the broadcast."""
    colocated_switch_s: float = 0.0
    """Colocated sync only: seconds per step to switch the GPUs between generation and training."""
    token_cost_slope_s: float = 0.0
    """Seconds each request in flight on a server adds to a token (`Costs.token_cost_slope_s`: the engine's batch curve)."""
    prompt_tokens: int = 0
    """Prompt tokens per sample (what an `abort` update makes a server prefill again, with the response so far)."""
    prefill_tokens_per_s: float = 0.0
    """Context tokens per second one server prefills (`update_mode=abort`); 0: free."""
    update_mode: str = "keep"
    """rollout.update_mode of the split run: keep, abort (partial rollouts resubmitted) or wait."""
    staleness_level: str = "group"
    """trainer.staleness_level of the split run: group or token."""
    admission: str = "pace"
    """trainer.admission of the split run: pace or bound."""
    colocated_trainer_tokens_per_s_per_gpu: float | None = None
    """Colocated sync's trainer (it may offload, and recompute log-probs); None: `trainer_tokens_per_s_per_gpu`."""
    split_step: int = 8
    """Splits are searched in multiples of this many GPUs (a node)."""
    reference: Reference | None = None
    scaling: Scaling = field(default_factory=Scaling)
    """What grows with the cluster: the weight broadcast to the servers, the trainer's gradient collectives."""
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, allowed in (("update_mode", UPDATE_MODES), ("staleness_level", STALENESS_LEVELS), ("admission", ("pace", "bound"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"profile {self.name}: {key} {getattr(self, key)!r} is not one of {allowed}")
        if self.token_cost_slope_s < 0 or self.prefill_tokens_per_s < 0 or self.prompt_tokens < 0:
            raise ValueError(f"profile {self.name}: token_cost_slope_s, prefill_tokens_per_s and prompt_tokens must be >= 0")

    def batch_groups(self, gpus: int) -> int:
        return max(1, round(self.groups * gpus / self.base_gpus))

    def costs(self, rollout_gpus: int, trainer_gpus: int, *, batch_gpus: int | None = None) -> Costs:
        """Costs of a split; `batch_gpus` (default: their sum) sets the batch under weak scaling.
        A publish broadcasts to every rollout GPU (`Scaling.publish_s`: each TP worker takes the
        full weights); every step all-reduces the gradients over the trainer's ranks
        (`Scaling.collective_s`, as the step's overhead)."""
        if rollout_gpus < self.gpus_per_server or trainer_gpus < 1:
            raise ValueError(f"split {rollout_gpus}:{trainer_gpus}: needs >= {self.gpus_per_server} rollout GPUs (gpus_per_server) and >= 1 trainer GPU")
        servers = rollout_gpus // self.gpus_per_server
        return Costs(servers=servers, max_concurrency=self.max_concurrency, token_cost_s=self.token_cost_s,
                     lengths=self.lengths, trainer_tokens_per_s=trainer_gpus * self.trainer_tokens_per_s_per_gpu,
                     groups=self.batch_groups(batch_gpus or rollout_gpus + trainer_gpus), group_size=self.group_size,
                     publish_s=self.publish_s + self.scaling.publish_s(servers * self.gpus_per_server),
                     step_overhead_s=self.scaling.collective_s(trainer_gpus), token_cost_slope_s=self.token_cost_slope_s,
                     prefill_token_cost_s=1.0 / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0,
                     prompt_tokens=self.prompt_tokens)

    def colocated(self, gpus: int) -> Costs:
        """Colocated sync: every GPU generates the batch of one published version (`publish_every`
        trainer steps' groups, all at once), then every GPU trains it (the baseline of
        `speedup_vs_sync`; one simulated step = one version). Its weights move within each GPU
        (resharding, no broadcast over the network), so its publish is the fixed part plus the
        switch; its training all-reduces over all `gpus` ranks, `publish_every` steps' worth."""
        c = self.costs(gpus, gpus, batch_gpus=gpus)
        rate = self.colocated_trainer_tokens_per_s_per_gpu or self.trainer_tokens_per_s_per_gpu
        return replace(c, groups=c.groups * self.publish_every, trainer_tokens_per_s=gpus * rate,
                       step_overhead_s=self.publish_every * c.step_overhead_s, publish_s=self.publish_s + self.colocated_switch_s)


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
