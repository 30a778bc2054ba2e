"""The work in flight at a checkpoint: what the checkpoint keeps of it, and how a resume puts it back.

Job: `capture` takes, at a checkpoint, what would otherwise die with the controller: the groups the
in-process (`memory`) queue holds, with their arrays (a durable queue keeps its own), and every group
still generating: its prompt, its admission version, the records of its samples that finished, and
what the servers report of the others (`partial_samples`: tokens, log-probs and per-token versions so
far, `inflight.py`). `write_async_state` stores that as `async_state.msgpack` beside state.json
(msgpack, arrays as raw bytes: no pickle). On resume, `reinstate` puts the queued groups back (their
versions as they were: ages run along the lineage) and hands the generating groups to the rollouter,
which continues their samples from the saved tokens before it admits new groups.

Durable queue: a group generating at the checkpoint may have finished and reached the queue before
the crash; `TrajectoryQueue.groups_held` (Redis: does the group's hash exist) finds those, and they
are neither continued nor generated again (counted `found_in_queue`). One that reached the queue and
was dropped there (too stale) before the crash is not found: it is continued and put again, its
uids then counted twice in the queue's `put` (once dropped, once as it ends now).

Consistency: `capture` first awaits the servers' reports, then reads everything else without an
await (the caller's state.json follows, also without one), so a sample is in exactly one place: a
queued group, a finished record of a running group, a saved partial (which may be a little behind:
any prefix of a sample's tokens is a valid place to continue from), or nowhere (generated again).
A group being put into the queue at that moment is kept with all its records and put again by the
rollouter (`queueing`); one being dropped is not kept.

Counts (`reinstate`'s, kept in state.json and summary.json `resume`): `queued_restored` records put
back, `finished_restored` samples of running groups that had finished, `found_in_queue` samples of
groups a durable queue already held, `in_flight` samples to run (each later counted `continued` or
`redone` by the rollouter, `Pipeline._resumed_sample`), `saved_partial` those with saved tokens,
`queued_lost` the in-process queue's records a Ray run does not keep (their arrays are in the actors'
planes, which the controller never reads: a durable queue keeps them).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec

from asyncrl.data.datasets import Prompt
from asyncrl.rollout.inflight import SavedSample
from asyncrl.rollout.router import ServerDied
from asyncrl.trajectory_queue import SavedRecord, load_record, save_record

STATE_FILE = "async_state.msgpack"
"""A checkpoint's in-flight and queued work, beside its state.json (written before it)."""


class SavedGroup(msgspec.Struct, forbid_unknown_fields=True):
    """A group that was in flight at the checkpoint. Its samples are `<group_id>-<i>`."""

    group_id: str
    version: int
    """The published version when it was admitted (what `StalenessManager.finish` is told)."""
    group_size: int
    prompt_index: int
    prompt_ids: list[int]
    answer: str
    finished: list[SavedRecord] = []
    """Records of its samples that had finished (with their arrays)."""
    partial: list[SavedSample] = []
    """Saved state of its samples still generating, as the servers reported it."""
    queueing: bool = False
    """Every sample had finished and the group was being put into the queue: put it, nothing to run."""


class AsyncState(msgspec.Struct, forbid_unknown_fields=True):
    """What a checkpoint keeps of the asynchronous pipeline besides state.json."""

    queued: list[SavedRecord] = []
    """The in-process queue's records (a durable queue keeps its own: empty)."""
    groups: list[SavedGroup] = []
    queued_not_kept: int = 0
    """The in-process queue's records not kept (`capture(keep_arrays=False)`): lost with the process."""


def write_async_state(ckpt: Path, state: AsyncState) -> None:
    tmp = ckpt / (STATE_FILE + ".tmp")
    tmp.write_bytes(msgspec.msgpack.encode(state))
    tmp.replace(ckpt / STATE_FILE)


def read_async_state(ckpt: Path) -> AsyncState | None:
    """The checkpoint's saved async state; None for a checkpoint written before it was kept."""
    path = ckpt / STATE_FILE
    return msgspec.msgpack.decode(path.read_bytes(), type=AsyncState) if path.exists() else None


async def capture(servers: Iterable[Any], rollouter: Any, queue: Any, keep_arrays: bool = True) -> AsyncState:
    """The queued and running work now (see the module docstring); no await after the servers answer.
    `keep_arrays=False` (the hosts write into other processes' planes, e.g. Ray actors): records are
    not read (trajectory arrays never pass through the controller), so the in-process queue's groups
    and the finished samples of running groups are generated again after a resume (counted `redone`);
    the generating samples' saved tokens are still kept."""
    partial: dict[str, SavedSample] = {}
    askable = [s for s in servers if hasattr(s, "partial_samples")]
    for got in await asyncio.gather(*(s.partial_samples() for s in askable), return_exceptions=True):
        if isinstance(got, (ServerDied, RuntimeError)):  # deliberate: a dead server's samples are generated again
            continue
        if isinstance(got, BaseException):
            raise got
        partial.update((p.uid, p) for p in got)
    plane = queue.storage
    queued = {g[0].group_id: g for g in queue.queued()}
    groups = []
    for g in rollouter.running():
        if g.group_id in queued:  # put, and the rollouter has not yet heard back
            continue
        groups.append(SavedGroup(
            g.group_id, g.version, len(g.samples), g.prompt.index, list(g.prompt.prompt_ids), str(g.prompt.answer),
            finished=[save_record(plane, r) for r in g.done.values()] if keep_arrays else [],
            partial=[partial[s.uid] for s in g.samples if s.index_in_group not in g.done and s.uid in partial],
            queueing=g.phase == "queueing"))
    records = [r for group in queued.values() for r in group]
    kept = [save_record(plane, r) for r in records] if keep_arrays else []
    return AsyncState(queued=kept, groups=groups, queued_not_kept=len(records) - len(kept))


async def reinstate(state: AsyncState, *, rollouter: Any, queue: Any) -> Counter[str]:
    """Put `state`'s queued groups back into `queue` and hand its running groups to `rollouter`
    (skipping groups the queue already holds); returns the counts of the module docstring, and
    `queued_groups`, the groups put back."""
    counts: Counter[str] = Counter()
    plane = queue.storage
    by_group: dict[str, list[SavedRecord]] = {}
    for r in state.queued:
        by_group.setdefault(r.group_id, []).append(r)
    held = await queue.groups_held([*by_group, *(g.group_id for g in state.groups)])
    back = [[load_record(plane, r) for r in sorted(rs, key=_index)] for gid, rs in by_group.items() if gid not in held]
    await queue.restore(back)
    counts["queued_restored"] += sum(len(g) for g in back)
    if state.queued_not_kept:
        counts["queued_lost"] += state.queued_not_kept
    counts["queued_groups"] += len(back)
    for g in state.groups:
        if g.group_id in held:  # finished and queued before the crash
            counts["found_in_queue"] += g.group_size
            continue
        done = {_index(r): load_record(plane, r) for r in g.finished}
        saved = {p.uid: p for p in g.partial}
        rollouter.resume(g.group_id, g.version, Prompt(index=g.prompt_index, text="", prompt_ids=list(g.prompt_ids), answer=g.answer),
                         done, saved, queueing=g.queueing and len(done) == g.group_size)
        counts["finished_restored"] += len(done)
        counts["in_flight"] += g.group_size - len(done)
        counts["saved_partial"] += sum(p.tokens > 0 for p in g.partial)
    return counts


async def run_group_moving(router: Any, samples: list[Any], free: Callable[[list[Any]], None] | None = None,
                           session_id: str | None = None) -> list[tuple[Any, str | None]]:
    """A group's samples (none resumed) in one call to the server `router` picks (`run_samples`: one Ray
    call per group, not per sample); (record, fate) of each, in order, as `run_moving` gives. When that
    server dies under them, each sample moves alone, as `run_moving` moves it: from the dead server's last
    snapshot of it where there is one (`continued`), else from its prompt (`redone`). Samples that had
    finished there are redone too: their records were in the call's unanswered reply."""
    try:
        records = await router.call_once(lambda host: host.run_samples(samples), len(samples), session_id)
    except ServerDied as exc:
        dead = exc.server  # type: ignore[attr-defined]
        return list(await asyncio.gather(*(run_moving(router, s, free=free, session_id=session_id, died_on=dead)
                                           for s in samples)))
    return [(r, None) for r in records]


async def run_moving(router: Any, sample: Any, resume: SavedSample | None = None,
                     free: Callable[[list[Any]], None] | None = None, session_id: str | None = None,
                     died_on: Any = None) -> tuple[Any, str | None]:
    """Run `sample` on the server `router` picks (`resume`: its state at a checkpoint). When that server
    dies under it, the router moves it to another, which continues from the dead server's last snapshot
    of it (`RemoteServer.snapshots`, collected by the health probe) where there is one, else as it began.
    Returns (its queue record, None if it never moved, else `continued` (saved tokens used) or `redone`);
    the dead servers' snapshots of it are then freed with `free` (their hosts cannot). `session_id`:
    the router's session (its group's id under `rollout.group_affinity`): where that session runs.
    `died_on`: a server the sample was running on that died already (its group's call,
    `run_group_moving`): the sample starts as moved off it.

    Trace: s0 generates 300 tokens of u; the probe collects s0's snapshot (280 tokens); s0 is killed ->
    the router moves u to s1 -> s1's host reads the snapshot, continues from token 280 -> `continued`."""
    tried: list[Any] = [] if died_on is None else [died_on]

    def on(host: Any) -> Any:
        snap = getattr(tried[-1], "snapshots", {}).get(sample.uid) if tried else None
        tried.append(host)
        if snap is not None:  # newer than a checkpoint's state: it holds those tokens too
            return host.run_sample(sample, None, snap)
        return host.run_sample(sample) if resume is None else host.run_sample(sample, resume)

    record = await router.call(on, session_id)
    if len(tried) == 1:
        return record, None
    spent = [h for s in tried[:-1] if (h := getattr(s, "snapshots", {}).pop(sample.uid, None)) is not None]
    if spent and free is not None:
        free(spent)
    return record, "continued" if int(record.meta.get("meta", {}).get("resumed_tokens", 0)) else "redone"


def _index(r: SavedRecord) -> int:
    return int(r.meta["index_in_group"])
