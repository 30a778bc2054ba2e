"""Ray shell of the trainer: `TrainerRankActor`, a rank's actor form (one per FSDP2 rank, each its own
process, titled `ray::TrainerRankActor`), and `TrainerGroup`, the controller's handle to N of them.

The actor only sets the torch.distributed environment (MASTER_ADDR / MASTER_PORT / RANK /
WORLD_SIZE, and `ASYNCRL_PG_KEY`: the group's random rendezvous prefix, so that a process reaching
rank 0's store without it cannot join, `setup.rendezvous_store`) and forwards verbs to a `TrainerRank` (`rank.py`), which reads its shard of each
batch from the data plane and, on rank 0, holds the weight plane's `Sender`. The group places
the actors in one placement group (a bundle per rank: `trainer.cpus_per_rank` CPUs, plus
`trainer.gpus_per_rank` GPUs when `trainer.device=cuda`, plus `trainer.ray_resources`) and fans every verb out to all ranks
(FSDP collectives need every rank), returning rank 0's result. What crosses Ray is small: a
plan of handles (msgpack bytes), metrics, a publish outcome. This is the only trainer module
that imports ray.

    group = TrainerGroup(2, model_path, trainer=cfg.trainer, algorithm=cfg.algorithm, queue=cfg.queue, weights=cfg.weights)
    metrics = group.train(plan)                           # same as TrainerRank.train
    outcome = group.publish(1, ["main-0"])                # the ranks stream to the servers' receivers
    group.close()

A rank that dies fails the verb in flight with `TrainerDied` (`rank.py`; the other ranks are killed: they
would wait for it in a collective); `asyncrl train` then restarts the run's processes from the last
checkpoint (`trainer.max_restarts`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.hosts import on_node
from asyncrl.orphan import NAMESPACE, Detached, DetachedNames, OrphanWatch, watched, while_name_taken
from asyncrl.trainer.plan import BatchPlan
from asyncrl.trainer.rank import TrainerDied, TrainerUnplaced, merge_outcomes


DEAD_PEER_S = 10.0
"""After a rank's verb failed, how long Ray is given to report another rank's death (its process
gone makes the survivors' collectives fail at once, before Ray has noticed)."""


@ray.remote
@watched
class TrainerRankActor:
    """One rank's process: built empty; `setup` joins the process group, loads the model, opens the planes
    (a `TrainerRank`, to which the verbs pass). In a detached run (`ray.detached`) it outlives the controller
    and watches for one (`asyncrl/orphan.py`)."""

    def __init__(self, rank: int, world_size: int, detached: dict[str, Any] | None = None) -> None:
        from asyncrl.malloc import fixed_mmap_threshold

        fixed_mmap_threshold()  # a model's process (asyncrl/malloc.py)
        self.rank, self.world_size = rank, world_size
        self.node = ray.util.get_node_ip_address()
        self.sockets = ""
        self.trainer: Any = None
        self._secret = ""
        self.watch: OrphanWatch | None = None
        if detached is not None:
            d = Detached(**detached)
            self.watch = OrphanWatch(d.orphan_timeout_s, lambda: _orphaned(self, d.placement))

    def rendezvous_address(self) -> tuple[str, int]:
        from asyncrl.trainer.setup import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int, model_path: str, engine_kwargs: dict[str, Any],
              queue: dict[str, Any], weights: dict[str, Any] | None, pg_key: str = "") -> dict[str, Any]:
        from asyncrl.trainer.setup import PG_KEY_ENV

        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",  # Ray pins one GPU per actor: it is cuda:0 here
        )  # fmt: skip
        if pg_key:  # every rank gets the same one from the group (without: torch's env:// rendezvous)
            os.environ[PG_KEY_ENV] = pg_key
        self.sockets = on_node(self.node, master_addr)  # gloo / NCCL sockets on the interface that reaches rank 0
        from checkpoint_engine import WeightsConfig
        from transfer_queue import TransferQueueConfig, make_storage

        from asyncrl.trainer.rank import TrainerRank, build_engine

        engine = build_engine(model_path, **engine_kwargs)
        self.trainer = TrainerRank(engine, plane=make_storage(TransferQueueConfig(**queue)),
                                   weights=WeightsConfig(**weights) if weights is not None else None)
        self._secret = queue.get("secret", "")
        return self.info()

    def info(self) -> dict[str, Any]:
        """What a controller needs of a rank it did not set up (a detached run taken back): step, endpoint."""
        return {"step": self.trainer.engine.step, "endpoint": self.trainer.endpoint, "published": self.trainer.published,
                "node": self.node, "ifname": self.sockets}

    def secret(self) -> str:
        """The run's secret, for a controller that takes the run back (`ray.detached`): whoever can call
        this holds the cluster's Ray token, which already reads the actors' arguments (their configs)."""
        return self._secret

    def touch(self) -> None:
        """The controller's keepalive (`ray.detached`); running it is the touch."""

    def train(self, plan: bytes) -> dict[str, float]:
        return self.trainer.train(plan)

    def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any] | None:
        return self.trainer.publish(version, receivers, probe)

    def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any] | None:
        return self.trainer.sync(receivers, resend, probe)

    def score(self, token_ids: list[int]) -> list[float] | None:
        return self.trainer.score(token_ids)

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def load(self, path: str) -> int:
        return self.trainer.load(path)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


def _room() -> str:
    """What the live Ray nodes have free, by node address (for a placement that found no room)."""
    free = ray.available_resources()
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
    custom = {k: v for k, v in free.items() if not k.startswith(("node:", "bundle_group", "memory", "object_store")) and "_group_" not in k}
    return f"{len(nodes)} live nodes ({', '.join(nodes)}), free {custom}"


def _orphaned(actor: Any, placement: str) -> None:
    """No controller for `ray.orphan_timeout_s`: close the rank, then remove the trainer's placement
    group (Ray ends every rank in it, this one too)."""
    try:
        actor.close()
    finally:
        remove_placement_group(ray.util.get_placement_group(placement))


class TrainerGroup:
    """N `TrainerRankActor`s acting as one trainer, with the blocking verbs of a `TrainerRank`: every verb
    runs on all ranks and returns rank 0's result."""

    def __init__(
        self,
        num_ranks: int,
        model_path: str,
        *,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        queue: Any,
        weights: Any = None,
        dtype: str = "float32",
        temperature: float = 1.0,
        seed: int = 0,
        critic: Any = None,
        lora: Any = None,
        placement_timeout_s: float = 300.0,
        detached: DetachedNames | None = None,
        orphan_timeout_s: float = 300.0,
    ) -> None:
        """`detached` (`ray.detached`): the ranks and their placement group are named after the run and
        outlive this process (each ends itself after `orphan_timeout_s` without a controller)."""
        if num_ranks < 1:
            raise ValueError(f"trainer.num_ranks: must be >= 1, got {num_ranks}")
        gpus = trainer.gpus_per_rank if trainer.device == "cuda" else 0.0
        bundle = {"CPU": trainer.cpus_per_rank, **({"GPU": gpus} if gpus else {}), **trainer.ray_resources}
        named = dict(name=detached.trainer_placement, lifetime="detached") if detached else {}
        self.placement = placement_group([dict(bundle) for _ in range(num_ranks)], strategy="PACK", **named)
        ready, _ = ray.wait([self.placement.ready()], timeout=placement_timeout_s)
        if not ready:
            remove_placement_group(self.placement)
            raise TrainerUnplaced(f"trainer placement: {num_ranks} bundles of {bundle} not placed in {placement_timeout_s:g} s "
                                  f"(trainer.placement_timeout_s; the cluster has {_room()}); lower trainer.num_ranks / "
                                  "trainer.gpus_per_rank, or wait for a node to come back")
        self.ranks = [
            while_name_taken(lambda r=r: TrainerRankActor.options(
                num_cpus=trainer.cpus_per_rank, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=r),
                **(dict(name=detached.rank(r), namespace=NAMESPACE, lifetime="detached") if detached else {}),
            ).remote(r, num_ranks, dataclasses.asdict(Detached(detached.rank(r), detached.trainer_placement, orphan_timeout_s))
                     if detached else None))
            for r in range(num_ranks)
        ]
        addr, port = ray.get(self.ranks[0].rendezvous_address.remote())
        kwargs = dict(trainer=trainer, algorithm=algorithm, critic=critic, lora=lora, dtype=dtype, temperature=temperature, seed=seed)
        wcfg = dataclasses.asdict(weights) if weights is not None else None
        pg_key = secrets.token_hex(16)  # the process group's rendezvous prefix: only these ranks know it
        self._died: str | None = None
        """Why the group was torn down (a rank died): every later verb is `TrainerDied` with it."""
        self._took(self._all("setup", addr, port, model_path, kwargs, dataclasses.asdict(queue), wcfg, pg_key))
        if detached is not None:
            self.keep_alive(orphan_timeout_s / 4)

    def _took(self, infos: list[dict[str, Any]]) -> None:
        self.step: int = infos[0]["step"]
        """Trainer steps taken (the policy version), as of the last verb."""
        self.endpoints: list[str] = [i["endpoint"] for i in infos if i["endpoint"]]
        """Where servers join the weight plane: rank 0's sender, or every rank's (sharded publish)."""
        self.published: int = max(i["published"] for i in infos)
        """The last version the ranks' senders published (-1 for a new group; a taken-back one's may be
        its checkpoint's: the next publish must exceed it)."""
        self.nodes: list[str] = [i["node"] for i in infos]
        """Each rank's node address, in rank order."""
        where = ", ".join(f"rank {r} on {i['node']} ({i['ifname'] or 'no interface found'})" for r, i in enumerate(infos))
        print(f"asyncrl: trainer {where}", flush=True)

    @classmethod
    def attach(cls, ranks: list[Any], placement: Any, orphan_timeout_s: float) -> "TrainerGroup":
        """The ranks of a detached run whose controller died, taken back as they are (set up, models
        loaded; `load` then brings them to a checkpoint)."""
        group = object.__new__(cls)
        group.ranks, group.placement, group._died = list(ranks), placement, None
        group._took(group._all("info"))
        group.keep_alive(orphan_timeout_s / 4)
        return group

    def keep_alive(self, every_s: float) -> None:
        """Touch every rank each `every_s` from a thread of this (the controller's) process, for as long
        as it lives and the group is up (`ray.detached`: their orphan watch must not fire while a long
        start, an evaluation or a slow rollout keeps the controller from calling them)."""
        def run() -> None:
            while self.ranks:
                time.sleep(every_s)
                try:
                    self.touch()
                except TrainerDied:  # deliberate: the group is gone; the verbs in flight say so
                    return

        threading.Thread(target=run, name="trainer-keepalive", daemon=True).start()

    @classmethod
    def find(cls, names: DetachedNames, num_ranks: int, timeout_s: float = 30.0) -> tuple[list[Any], Any, bool]:
        """A detached run's ranks and placement group where they still run: (the rank actors found,
        the placement group or None, whether all `num_ranks` are there and answer within `timeout_s`)."""
        try:
            placement = ray.util.get_placement_group(names.trainer_placement)
        except ValueError:
            placement = None
        found = []
        for r in range(num_ranks):
            try:
                found.append(ray.get_actor(names.rank(r), namespace=NAMESPACE))
            except ValueError:
                pass
        alive = placement is not None and len(found) == num_ranks
        if alive:
            try:
                ray.get([w.pid.remote() for w in found], timeout=timeout_s)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                alive = False
        return found, placement, alive

    def touch(self) -> None:
        """The controller's keepalive (`ray.detached`): every rank's orphan watch is reset."""
        self._all("touch")

    def secret(self) -> str:
        return ray.get(self.ranks[0].secret.remote())

    def _all(self, verb: str, *args: Any) -> list[Any]:
        """`verb` on every rank; results in rank order. A rank that dies fails the verb at once:
        its peers would wait in a collective for it (gloo's timeout is 30 min), so every rank is
        killed and `TrainerDied` raised (the run restarts from its last checkpoint), for this verb and
        for every later one (e.g. a train step after a server's sync found the rank dead)."""
        if self._died is not None:
            raise TrainerDied(f"{self._died}; the group is gone ({verb} not run)")
        refs = [getattr(r, verb).remote(*args) for r in self.ranks]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except RayActorError as exc:
                self._kill(f"trainer rank {refs.index(ready[0])} died during {verb}: {type(exc).__name__}")
                raise TrainerDied(self._died) from exc
            except RayTaskError as exc:  # a peer's death often shows first as this rank's collective failing
                rank = self._dead_rank(refs, ready[0])
                if rank is None:
                    raise
                self._kill(f"trainer rank {rank} died during {verb} (a peer's collective failed first)")
                raise TrainerDied(self._died) from exc
        return ray.get(refs)

    @staticmethod
    def _dead_rank(refs: list[Any], failed: Any) -> int | None:
        """The rank among the others whose process is gone, waiting up to `DEAD_PEER_S` for Ray to
        tell; None if all of them are alive (then `failed`'s error is the rank's own)."""
        others = [r for r in refs if r is not failed]
        done, _ = ray.wait(others, num_returns=len(others), timeout=DEAD_PEER_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                return refs.index(ref)
            except RayTaskError:
                pass
        return None

    def _kill(self, why: str = "the trainer group was closed") -> None:
        self._died = self._died or why
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.ranks = []
        remove_placement_group(self.placement)

    def train(self, plan: BatchPlan | bytes) -> dict[str, float]:
        data = plan.to_bytes() if isinstance(plan, BatchPlan) else plan
        outs = self._all("train", data)
        metrics = outs[0]
        unreadable = {u: why for out in outs for u, why in out.get("unreadable", {}).items()}  # every rank's rows
        if unreadable:
            metrics["unreadable"] = unreadable
        self.step += 1
        return metrics

    def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any]:
        return merge_outcomes(self._all("publish", version, list(receivers), probe))

    def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any]:
        return merge_outcomes(self._all("sync", list(receivers), resend, probe))

    def score(self, token_ids: list[int]) -> list[float] | None:
        """The parity probe's reference under the weights last published (every rank runs the forward)."""
        return self._all("score", list(token_ids))[0]

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self.step = self._all("load", path)[0]

    def pids(self) -> list[int]:
        return self._all("pid")

    def close(self) -> None:
        """Close every rank and end the actors."""
        if not self.ranks:
            return
        try:
            self._all("close")
        except TrainerDied:  # deliberate: a dead group is closed (`_all` killed the rest)
            return
        self._kill()
