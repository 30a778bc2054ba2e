"""TrainerRank: what runs in one trainer process: its engine, its data plane and its weight sender.

Job: per step, read this rank's shard of the batch straight from the data plane
(`plan.load_shard`) and train on it (`TrainerEngine.train_local`); per publish, stream the
weights bucket by bucket into the weight plane to exactly the receivers the caller names,
and report who loaded them. Two layouts, chosen by the backend:
- sharded (pull backends `local`, `shm`, `nixl`, `cuda_ipc`, more than one rank): every rank has
  a `Sender` and publishes its own rows of every parameter (`iter_local_shards`, no collective);
  servers join every rank and assemble the pieces (`checkpoint_engine.sharded`);
- gathered (`gloo`, `nccl`, whose broadcast group has one root, or one rank): rank 0's `Sender`
  streams the full tensors, one FSDP unit at a time, the other ranks join the all-gathers. The controller sends a plan and "publish version v"; no trajectory tensor
and no weight byte passes through it. The rank lives in the controller's own process (the embedded
default: one rank, the `local` planes) or in a Ray actor (`TrainerRankActor`, `actor.py`), N of
them driven as one by a `TrainerGroup`, which has these same blocking verbs.

    rank = TrainerRank(engine, plane=make_storage(cfg.queue), weights=cfg.weights)
    metrics = rank.train(plan)                       # plan: BatchPlan or its bytes
    outcome = rank.publish(3, ["main-0", "main-1"])  # rank 0: {"completed": [...], "evicted": {...}, ...}

Boundary: no Ray, no servers beyond receiver ids, no queue metadata (acks are the
controller's). Every verb is collective: all ranks are called with the same arguments.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from asyncrl.trainer.plan import BatchPlan, load_shard
from transfer_queue import StoragePlane

SYNC_JOIN_S = 5.0
"""How long a `sync` waits for its receivers' connection and Join (at most `weights.timeout_s`). The fleet
makes a server join the weight plane before it asks for its sync, so both arrive within milliseconds (1-2 s
seen on a loaded 2-core host); one not there by then died meanwhile (a server killed as it started). It is
reported not loaded and its restart goes on, where waiting `timeout_s` held the trainer as long: its verbs
run one at a time."""


class TrainerUnplaced(RuntimeError):
    """The trainer ranks' placement group found no room within `trainer.placement_timeout_s` (at a restart:
    the host of a rank died and the hosts left lack room). `asyncrl train` stops with the command that resumes
    the run once the cluster has room again."""


class TrainerDied(RuntimeError):
    """A trainer rank's process is gone (or the group was torn down because one was): the run
    restarts its processes from the last checkpoint (`trainer.max_restarts`)."""


def build_engine(model_path: str, *, trainer: Any, **kw: Any) -> Any:
    """The engine named by `trainer.engine`: `fsdp` (`TrainerEngine`) or `cost_model`."""
    if trainer.engine == "cost_model":
        from asyncrl.trainer.cost_model import CostModelEngine

        return CostModelEngine(model_path, cost_per_token_s=trainer.cost_model_token_s, trainer=trainer, **kw)
    from asyncrl.trainer.engine import TrainerEngine

    return TrainerEngine(model_path, trainer=trainer, **kw)


class TrainerRank:
    def __init__(self, engine: Any, *, plane: Any, weights: Any = None) -> None:
        """`engine`: a `TrainerEngine` (or any object with its verbs); `plane`: the data plane this
        process reads trajectories from; `weights`: the `WeightsConfig` (rank 0 builds the `Sender`)."""
        self.engine, self.plane = engine, plane
        self.device = getattr(weights, "device", "cpu")
        self.sharded = weights is not None and engine.world > 1 and weights.backend in SHARDED_BACKENDS
        """Every rank publishes its own rows (see the module docstring)."""
        self.sender = None
        if weights is not None and (engine.rank == 0 or self.sharded):
            from checkpoint_engine import Sender

            self.sender = Sender(weights)
        self.last_read_s = 0.0
        """Seconds the last `train` spent reading its shard from the data plane."""

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def step(self) -> int:
        return self.engine.step

    @property
    def endpoint(self) -> str:
        """Where receivers join this rank's sender ('' for a rank without one)."""
        return self.sender.endpoint if self.sender is not None else ""

    @property
    def published(self) -> int:
        """The last version this rank's sender published (-1: none, or no sender)."""
        return self.sender.membership.version if self.sender is not None else -1

    @property
    def endpoints(self) -> list[str]:
        """Where receivers join the weight plane: this rank's sender (one rank in this process)."""
        return [self.endpoint] if self.endpoint else []

    def train(self, plan: BatchPlan | bytes) -> dict[str, Any]:
        """One trainer step on this rank's shard of `plan`; returns the step's metrics, and under
        `unreadable` the rows whose producer could not be reached ({uid: why}; see `plan.load_shard`)."""
        if isinstance(plan, (bytes, bytearray, memoryview)):
            plan = BatchPlan.from_bytes(bytes(plan))
        t0, b0 = time.perf_counter(), StoragePlane.delivered_bytes
        parts, real, unreadable = load_shard(plan, self.plane, self.engine.rank, self.engine.world)
        self.last_read_s = time.perf_counter() - t0
        read_bytes = StoragePlane.delivered_bytes - b0
        metrics: dict[str, Any] = self.engine.train_local(parts, real, plan.version, plan.lineage)
        metrics.update(read_s=self.last_read_s, read_bytes=float(read_bytes))
        if unreadable:  # {uid: why}: not trained (padding rows); the controller drops them, counted
            metrics["unreadable"] = unreadable
        return metrics

    def _params(self) -> Iterator[Any]:
        """What this rank sends: its rows (sharded), or the full parameters (gathered), timing
        how long producing them took (`gather_s` of the last publish)."""
        self.gather_s = 0.0
        if self.sharded:
            it: Iterator[Any] = self.engine.iter_local_shards(device=self.device)
        else:
            it = self.engine.iter_full_params(device=self.device, borrowed=True)  # the packer copies each into a bucket
        while True:
            t0 = time.perf_counter()
            item = next(it, None)
            self.gather_s += time.perf_counter() - t0
            if item is None:
                return
            yield item

    def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any] | None:
        """Send the current weights as `version` to `receivers`; returns (rank 0) once each one
        loaded them or was evicted: `{"version", "completed", "evicted", "bytes", "seconds", ...}`.
        `probe`: also score these tokens with the weights just sent (`"probe"`: the parity probe's
        reference, taken in the same verb so no step can change the weights in between)."""
        t0 = time.perf_counter()
        return _timed(self._probed(self._publish(version, receivers), probe), "rank_s", t0)

    def _probed(self, out: dict[str, Any] | None, probe: list[int] | None) -> dict[str, Any] | None:
        if probe:
            t0 = time.perf_counter()
            reference = self.score(probe)  # every rank: the forward is collective
            if out is not None:
                out["probe"] = reference
            _timed(out, "probe_s", t0)
        return out

    def _publish(self, version: int, receivers: list[str]) -> dict[str, Any] | None:
        """The transfer, its phases timed (`join_s`, the sender's `seconds`, `finish_s`: `publish_phases.py`)."""
        params, out = self._params(), None
        try:
            if self.sender is not None:
                t0 = time.perf_counter()
                missing = self.sender.wait_for_ids(receivers, self.sender.config.timeout_s)
                join_s = time.perf_counter() - t0
                sent = self.sender.publish(params, version, receivers=[r for r in receivers if r not in missing])
                sent.evicted.update({r: "not joined" for r in missing})
                out = dict(_outcome(sent), gather_s=self.gather_s, join_s=join_s)
        finally:
            t1 = time.perf_counter()
            self._finish(params)
            _timed(out, "finish_s", t1)
        return out

    def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any] | None:
        """Bring `receivers` that do not hold the current version (restarted, evicted) to it;
        `resend`: send it to them even if they acknowledged it (a failed parity check). What is sent
        are the current weights (which may have trained past the version's), so `probe` is scored
        with them, in this verb, as in `publish`."""
        return self._probed(self._sync(receivers, resend), probe)

    def _sync(self, receivers: list[str], resend: bool) -> dict[str, Any] | None:
        params = self._params()
        try:
            if self.sender is None:
                return None
            # a restarted server's process: its connection, then its Join (until then the dead one's entry stands for it)
            missing = self.sender.wait_for_ids(receivers, min(self.sender.config.timeout_s, SYNC_JOIN_S), connected=True)
            out = self.sender.sync(params, receivers=receivers, resend=resend)
            if out is None:  # nobody behind: the live ones among them already hold it
                m = self.sender.membership
                current = [r for r in receivers if r in m.live() and r not in m.behind() and r not in missing]
                return {"version": m.version, "completed": current, "evicted": {r: "not joined" for r in missing},
                        "bytes": 0, "seconds": 0.0, "gbps": 0.0, "buckets": 0, "gather_s": 0.0}
            return dict(_outcome(out), gather_s=self.gather_s)
        finally:
            self._finish(params)

    def _finish(self, params: Iterator[Any]) -> None:
        if not self.sharded:  # the other ranks all-gather every tensor: so must this one, whatever happened
            _drain(params)
        reshard = getattr(self.engine, "reshard", None)
        if reshard is not None:  # whether or not this rank read its shards, every rank leaves FSDP alike
            reshard()

    def score(self, token_ids: list[int]) -> list[float] | None:
        """Log-probs of `token_ids[1:]` under the weights last published (the parity probe's reference);
        None for an engine without a model. Collective: every rank runs the forward."""
        score = getattr(self.engine, "score_tokens", None)
        return score(token_ids) if score is not None else None

    def save(self, path: str) -> None:
        self.engine.save(path)

    def load(self, path: str) -> int:
        self.engine.load(path)
        return self.engine.step

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.engine.close()


def _drain(it: Iterator[Any]) -> None:
    for _ in it:
        pass


SHARDED_BACKENDS = ("local", "shm", "nixl", "cuda_ipc")
"""Pull backends: a receiver can read from any number of senders (collectives have one root)."""


def merge_outcomes(outs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """One publish outcome from the ranks' (sharded: each sent its rows; loaded = loaded from all)."""
    outs = [o for o in outs if o is not None]
    if len(outs) == 1:
        return outs[0]
    completed = set(outs[0]["completed"]).intersection(*(o["completed"] for o in outs[1:]))
    evicted: dict[str, str] = {}
    for o in outs:
        evicted.update(o["evicted"])
    return {"version": outs[0]["version"], "completed": sorted(completed), "evicted": evicted,
            "bytes": sum(o["bytes"] for o in outs), "seconds": max(o["seconds"] for o in outs),
            "gbps": sum(o["bytes"] for o in outs) / max(max(o["seconds"] for o in outs), 1e-9) / 1e9,
            "buckets": sum(o["buckets"] for o in outs), "gather_s": max(o.get("gather_s", 0.0) for o in outs),
            **{k: max(o.get(k, 0.0) for o in outs) for k in PHASE_TIMES},  # the slowest rank's: all wait for it
            **({"probe": outs[0]["probe"]} if "probe" in outs[0] else {})}


PHASE_TIMES = ("join_s", "finish_s", "probe_s", "rank_s")
"""What a rank's publish times besides the sender's `seconds` (`asyncrl/rollout/publish_phases.py`)."""


def _timed(out: dict[str, Any] | None, key: str, since: float) -> dict[str, Any] | None:
    """`out` with the seconds from `since` to now under `key` (a rank without an outcome has none)."""
    if out is not None:
        out[key] = time.perf_counter() - since
    return out


def _outcome(out: Any) -> dict[str, Any]:
    return {"version": out.version, "completed": list(out.completed), "evicted": dict(out.evicted), "bytes": out.bytes,
            "seconds": out.seconds, "gbps": out.gbps, "buckets": out.buckets}
