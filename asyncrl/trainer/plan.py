"""BatchPlan: what the controller sends the trainer for one step, and how a rank reads its shard.

The controller never fetches a trajectory's tensors. It takes whole groups from the queue
(metadata and data-plane handles), computes one advantage per trajectory from the rewards and
group ids it holds, and sends every rank the same small plan: per trajectory its handles and
its advantage. Each rank then reads only its own rows of every mini-batch straight from the
storage units (`load_shard`: shm on one host, zmq or nixl across hosts) into numpy views and
pads them into `TrainBatch` tensors, no Python lists of tokens anywhere.

Layout, shared with `TrainerEngine.train_step` (the full-batch path gives the same split):
the rows are cut into `minibatches` contiguous mini-batches of ceil(B / n) rows (whole
groups when the rows are group-ordered); within each mini-batch the rows are spread over the W
ranks by tokens (`spread`: longest first, each to the rank with the fewest tokens that still has
room for p = ceil(rows / W) rows), so a long-tail batch does not leave one rank with the long rows
and the others waiting. A rank short of rows gets padding rows with loss mask 0, so every rank runs
the same forward/backward passes (FSDP collectives must match) and the padding adds exactly zero to
losses and gradients.

    plan = BatchPlan(rows=[PlanRow("u0", handles, 0.5), ...], pad_id=0, minibatches=4)
    parts, real_rows, unreadable = load_shard(plan, plane, rank=1, world=2)   # one TrainBatch per mini-batch
    metrics = engine.train_local(parts, real_rows)

Wire: `to_bytes` / `from_bytes` (msgpack through msgspec, typed on decode), the form it takes
through a Ray call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec
import numpy as np

from asyncrl.trainer.spread import spread
from transfer_queue.storage.handles import Handle

FIELDS = ("prompt_ids", "response_ids", "behavior_logprobs", "loss_mask", "token_versions")
"""Tensor fields of a trajectory record that a rank reads (see `asyncrl.trajectory_queue`)."""


@dataclass
class PlanRow:
    """One trajectory of the batch."""

    uid: str
    handles: dict[str, Handle]
    """Field name -> data-plane handle (typed, tagged by plane), for every name in `FIELDS`."""
    advantage: float
    """The sequence advantage, broadcast over the response's loss tokens by the rank."""
    score: float = 0.0
    """The sequence reward: what GAE (`algorithm.advantage=gae`, computed on the rank with the critic) reads."""


@dataclass
class BatchPlan:
    """One trainer step. Invariant: `rows` are in group order (a group's rows are contiguous)."""

    rows: list[PlanRow]
    pad_id: int
    """Token id of padding columns and padding rows."""
    minibatches: int = 1
    """Optimizer steps of this trainer step (`trainer.minibatches`, at most one per row)."""
    version: int = -1
    """The policy version the trainer's weights carry at this step (what token versions are aged
    against); -1: the engine's step count (a run that never resumed past a publish)."""
    lineage: list[list[int]] = field(default_factory=list)
    """The run's resumes (`transfer_queue.rules.Lineage`): token ages are measured along them."""

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> "BatchPlan":
        return msgspec.msgpack.decode(data, type=cls)

    def shard(self, rank: int, world: int) -> list[list[PlanRow | None]]:
        """Rank `rank`'s rows of each mini-batch (`spread` by tokens); None marks a padding row."""
        out = []
        for mb in minibatch_slices(len(self.rows), self.minibatches):
            rows = self.rows[mb]
            per = -(-len(rows) // world)
            mine: list[PlanRow | None] = [rows[i] for i in spread([row_tokens(r) for r in rows], world)[rank]]
            out.append(mine + [None] * (per - len(mine)))
        return out


def row_tokens(row: PlanRow) -> int:
    """Prompt and response tokens of a plan row, from its handles' shapes (no read)."""
    from transfer_queue.storage.handles import as_handle

    return sum(int(shape[0]) if (shape := as_handle(row.handles[f]).shape) else 0 for f in ("prompt_ids", "response_ids"))


def minibatch_slices(num_rows: int, minibatches: int) -> list[slice]:
    """The contiguous mini-batches of a step: min(minibatches, rows) slices of ceil(rows / n) rows."""
    n = max(1, min(minibatches, num_rows))
    per = -(-num_rows // n)
    return [slice(i, min(i + per, num_rows)) for i in range(0, num_rows, per)]


def load_shard(plan: BatchPlan, plane: Any, rank: int, world: int) -> tuple[list[Any], list[int], dict[str, str]]:
    """This rank's `TrainBatch` of every mini-batch of `plan`, read from `plane` (one read per producer
    and mini-batch), the number of real (non-padding) rows in each, and the rows it could not read:
    {uid: why} of those whose producer did not answer within `queue.read_timeout_s` (its process gone or
    its host cut off: `StorageUnreachable`). Those rows become padding rows (no loss, the same shapes on
    every rank), so the step goes on with the rest; the controller drops them, counted as `unreadable`."""
    from asyncrl.trainer.batch import TrainBatch
    from transfer_queue.storage.handles import as_handle

    parts, real, unreadable = [], [], {}
    for rows in plan.shard(rank, world):
        mine = [r for r in rows if r is not None]
        arrays, failed = plane.read_by_source([r.handles[f] for r in mine for f in FIELDS]) if mine else ([], {})
        per_row: list[dict[str, np.ndarray] | None] = []
        for i, row in enumerate(mine):
            got = arrays[i * len(FIELDS):(i + 1) * len(FIELDS)]
            if any(a is None for a in got):
                source = next(as_handle(row.handles[f]).source for f, a in zip(FIELDS, got) if a is None)
                unreadable[row.uid] = failed.get(source, source)
                per_row.append(None)
            else:
                per_row.append(dict(zip(FIELDS, got)))
        per_row += [None] * (len(rows) - len(mine))
        kept = [r if r is not None and row is not None else None for r, row in zip(rows, per_row)]
        parts.append(TrainBatch.from_arrays(per_row, [r.advantage if r else 0.0 for r in kept], pad_id=plan.pad_id,
                                            scores=[r.score if r else 0.0 for r in kept]))
        real.append(sum(row is not None for row in per_row))
    return parts, real, unreadable


def plan_rows(samples: Sequence[Any], advantages: Sequence[float], scores: Sequence[float] | None = None) -> list[PlanRow]:
    """Rows of a plan from queue `SampleMeta`s (in group order), their advantages and rewards."""
    scores = [0.0] * len(samples) if scores is None else scores
    return [PlanRow(s.uid, {f: s.handles[f] for f in FIELDS}, float(a), float(r)) for s, a, r in zip(samples, advantages, scores)]
