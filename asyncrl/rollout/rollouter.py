"""Rollouter: starts groups of samples under the admission rule and queues finished groups.

Before starting each group it waits for a free fleet slot (`max_running_samples`: fewer
samples generating than the fleet runs at once, so a group's samples start together
instead of queueing in the servers) and then on `StalenessManager.acquire()` (that is
where the mode lives), which also records the version each running group started at (what
in-order consumption waits on). It runs the group's `group_size` samples concurrently
through `run_sample` (the router sends each to a server's host, which runs the AgentLoop
and writes the trajectory into its data plane) and gets back one queue record per sample:
metadata and handles, never the tensors. The finished group goes to `sink(group)`. A group
whose every reward failed is dropped and counted (`dropped["reward_failed"]`, its tensors
freed through `discard`), so a broken reward function shows up in the metrics instead of
silently training on zeros. With `filter_groups` (DAPO dynamic sampling,
`algorithm.filter_groups`) a group whose rewards are all equal carries no advantage signal
and is dropped the same way, counted as `dropped["filtered"]`; its place under the admission
rule is freed, so a new group is started and the batch is refilled. A task the policy always
solves (or always fails) would refill forever: `filter_groups_max_batches` batches' worth of
groups filtered in a row (`algorithm.filter_groups_max_batches` x the batch's groups) raise
`EndlessFiltering`, which stops the run; a queued group resets the count. With `shaping`
(`OverlongShaping`, `agent.overlong_buffer_len`) each queued record's reward is shaped after the
filter, which compares the unshaped scores (DAPO filters on accuracy). An exception inside a
sample stops the run loudly (errors propagate through `run`).

Trace (filter on, 2 groups per batch, max 2 batches -> limit 4): filtered, filtered, filtered,
queued (count back to 0), filtered x 4 -> `EndlessFiltering` at the fourth, counted as dropped.

Checkpoints: `running()` lists the groups in flight (prompt, admission version, the records of
the samples that finished) for the controller to save; `resume(...)` takes such a group back after
a restart, with the samples that had finished and the saved state of the others, and `run` starts
it before any new group: its samples continue from their saved tokens (`inflight.py`), or start
again from the prompt where nothing was saved. `on_resumed(fate, record)` hears how each of its
samples ended: `continued` (saved tokens used) or `redone`.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

from asyncrl.engines.sample import Sample
from asyncrl.data.datasets import Prompt
from asyncrl.rollout.shaping import OverlongShaping
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import generated_tokens, response_length, reward, reward_failed

Group = list[Any]
"""The queue records (`SampleMeta`) of one group's samples, in index order."""


@dataclass(eq=False)
class RunningGroup:
    """A group the rollouter started and has not finished with."""

    group_id: str
    version: int
    """What `StalenessManager.acquire` returned for it (passed back to `finish`)."""
    prompt: Prompt
    samples: list[Sample]
    done: dict[int, Any] = field(default_factory=dict)
    """index in group -> the record of a sample that finished."""
    phase: str = "generating"
    """`generating`, `queueing` (all done, being put into the queue), `dropping` (all done, dropped)."""
    resumed: bool = False
    """Taken back from a checkpoint (`Rollouter.resume`)."""


class EndlessFiltering(RuntimeError):
    """`algorithm.filter_groups` dropped so many groups in a row that the batch would never fill."""


class Rollouter:
    def __init__(
        self,
        *,
        run_sample: Callable[[Sample], Awaitable[Any]],
        prompts: Iterator[Prompt],
        staleness: StalenessManager,
        sink: Callable[[Group], Awaitable[None]],
        discard: Callable[[Group], Awaitable[None]],
        group_size: int,
        max_running_samples: int = 0,
        filter_groups: bool = False,
        filter_groups_max_batches: int = 0,
        shaping: OverlongShaping | None = None,
        lengths: Any = None,
        on_resumed: Callable[[str, Any], None] | None = None,
        on_group_end: Callable[[str], None] | None = None,
        run_group: Callable[[list[Sample]], Awaitable[list[Any]]] | None = None,
    ) -> None:
        """`filter_groups_max_batches`: filtered groups in a row that stop the run, in batches of
        `staleness.batch_groups` groups (0: no limit). `shaping`: applied to every queued record.
        `on_group_end(group_id)`: once no sample of the group runs any more (the router forgets its session).
        `run_group(samples)`: a new group's samples in one call, their records in order (a group taken back
        from a checkpoint runs sample by sample, `run_sample`, each from its saved state)."""
        if filter_groups and group_size < 2:
            raise ValueError(f"algorithm.filter_groups needs rollout.group_size >= 2 (a group of one always has equal rewards), got {group_size}")
        self.run_sample, self.run_group, self.prompts = run_sample, run_group, prompts
        self.on_group_end = on_group_end
        self.staleness, self.sink, self.discard, self.group_size = staleness, sink, discard, group_size
        self.max_running_samples, self.filter_groups = max_running_samples, filter_groups
        self.filter_groups_max_batches, self.shaping = filter_groups_max_batches, shaping
        self.lengths = lengths
        """A `LengthBias` told the response lengths of the groups dropped here (None: not counted)."""
        self.filtered_in_a_row = 0
        """Groups dropped by the filter since the last queued group."""
        self.running_samples = 0
        self._slot_freed = asyncio.Event()
        """Set as a sample ends: what `_wait_for_slot` (the run loop, the one waiter) waits for. An event set per
        sample, not a condition's lock and notify per sample (the controller's hot path)."""
        self.reward_failures = 0
        self.generated_tokens = 0
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._run_task: asyncio.Task | None = None
        self.on_resumed = on_resumed
        """Told `(fate, record)` for each sample of a resumed group that ran: `continued` or `redone`."""
        self._groups: dict[str, RunningGroup] = {}
        self._resumed: list[tuple[RunningGroup, dict[str, Any]]] = []
        """Groups taken back from a checkpoint, with their samples' saved state by uid; `run` starts them first."""

    def idle_seconds(self) -> float:
        """Seconds with no group generating because admission (the staleness bound) held new ones back."""
        return self.staleness.idle_seconds()

    async def run(self) -> None:
        """Start groups forever (until cancelled); raises the first error of any group."""
        self._run_task = asyncio.current_task()
        try:
            resumed, self._resumed = self._resumed, []
            for g, saved in resumed:
                self._start(g, saved)
            while True:
                await self._wait_for_slot()
                version = await self.staleness.acquire()
                prompt = next(self.prompts)
                self._start(self._new_group(prompt, version), {})
        except asyncio.CancelledError:
            if self._error is not None:
                raise self._error from None
            raise
        finally:
            for t in self._tasks:
                t.cancel()

    def _start(self, g: RunningGroup, saved: dict[str, Any]) -> None:
        self.running_samples += self.group_size - len(g.done)
        self._groups[g.group_id] = g
        t = asyncio.create_task(self._run_group(g, saved))
        self._tasks.add(t)
        t.add_done_callback(self._done)

    def running(self) -> list[RunningGroup]:
        """The groups in flight now (generating, or being queued), for a checkpoint; not those being dropped."""
        return [g for g in self._groups.values() if g.phase != "dropping"]

    def resume(self, group_id: str, version: int, prompt: Prompt, done: dict[int, Any], saved: dict[str, Any], *,
               queueing: bool = False) -> None:
        """Take back a group that was in flight at a checkpoint: admitted at `version`, `done` the
        records of its samples that had finished, `saved` the others' saved state by uid (an
        `inflight.SavedSample`; a sample without one starts again from the prompt). `queueing`: it
        was being put into the queue (every record done, filtered and shaped): it is only put. Counted
        as running at once; `run` starts it before any new group."""
        g = RunningGroup(group_id, version, prompt, self._samples(group_id, prompt), dict(done),
                         phase="queueing" if queueing else "generating", resumed=True)
        self.staleness.readmit(version)
        self._resumed.append((g, saved))

    def _new_group(self, prompt: Prompt, version: int) -> RunningGroup:
        gid = uuid.uuid4().hex[:12]
        return RunningGroup(gid, version, prompt, self._samples(gid, prompt))

    def _samples(self, gid: str, prompt: Prompt) -> list[Sample]:
        return [
            Sample(
                uid=f"{gid}-{i}",
                group_id=gid,
                index_in_group=i,
                group_size=self.group_size,
                prompt_ids=prompt.prompt_ids,
                answer=prompt.answer,
                meta={"data_index": prompt.index},
            )
            for i in range(self.group_size)
        ]

    async def _wait_for_slot(self) -> None:
        """Fleet back-pressure: wait while every slot is taken (a group may overfill by up to
        group_size - 1 samples, which start as soon as short samples finish)."""
        while self.max_running_samples and self.running_samples >= self.max_running_samples:
            self._slot_freed.clear()
            await self._slot_freed.wait()

    async def _run_sample(self, g: RunningGroup, s: Sample, saved: Any = None) -> None:
        try:
            record = await (self.run_sample(s) if saved is None else self.run_sample(s, saved))
            g.done[s.index_in_group] = record
            if g.resumed and self.on_resumed is not None:
                used = int(record.meta.get("meta", {}).get("resumed_tokens", 0))
                self.on_resumed("continued" if used > 0 else "redone", record)
        finally:
            self.running_samples -= 1
            self._slot_freed.set()

    async def _run_samples(self, g: RunningGroup, samples: list[Sample]) -> None:
        try:
            for s, record in zip(samples, await self.run_group(samples), strict=True):  # type: ignore[misc]
                g.done[s.index_in_group] = record
        finally:
            self.running_samples -= len(samples)
            self._slot_freed.set()

    def _done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None and self._error is None:
            self._error = t.exception()
            self._run_task.cancel()  # run() re-raises the group's error

    async def _run_group(self, g: RunningGroup, saved: dict[str, Any]) -> None:
        try:
            todo = [s for s in g.samples if s.index_in_group not in g.done]
            if self.run_group is not None and not g.resumed and len(todo) > 1:
                await self._run_samples(g, todo)
            else:
                await asyncio.gather(*(self._run_sample(g, s, saved.get(s.uid)) for s in todo))
            group = [g.done[i] for i in range(self.group_size)]
            await self._finish(g, group, new=[g.done[s.index_in_group] for s in todo])
        finally:
            self._groups.pop(g.group_id, None)
            if self.on_group_end is not None:
                self.on_group_end(g.group_id)

    async def _finish(self, g: RunningGroup, group: list[Any], new: list[Any]) -> None:
        version = g.version
        if g.phase == "queueing":  # resumed as it was being queued: checked and shaped before the checkpoint
            await self.sink(group)
            await self.staleness.finish(accepted=True, version=version)
            return
        self.generated_tokens += sum(generated_tokens(m) for m in new)
        failed = sum(reward_failed(m) for m in group)
        self.reward_failures += sum(reward_failed(m) for m in new)
        if failed == len(group):
            g.phase = "dropping"
            self._count_lengths("dropped_reward_failed", group)
            await self.discard(group)
            await self.staleness.finish(accepted=False, cause="reward_failed", version=version)
            return
        if self.filter_groups and len({reward(m) for m in group}) == 1:
            g.phase = "dropping"
            self._count_lengths("dropped_filtered", group)
            await self.discard(group)
            await self.staleness.finish(accepted=False, cause="filtered", version=version)
            self._filtered(reward(group[0]))
            return
        self.filtered_in_a_row = 0
        g.phase = "queueing"  # from here a checkpoint keeps it as queued: shaped once, not again after a resume
        if self.shaping is not None:
            for m in group:
                self.shaping.apply(m)
        await self.sink(group)  # queued before it stops counting as running: in-order consumption waits on it
        await self.staleness.finish(accepted=True, version=version)

    def _count_lengths(self, fate: str, group: list[Any]) -> None:
        if self.lengths is not None:
            self.lengths.add(fate, (response_length(m) for m in group))

    def _filtered(self, value: float) -> None:
        """Count a filtered group; the limit's worth in a row raise `EndlessFiltering` (stops the run)."""
        self.filtered_in_a_row += 1
        per_batch = self.staleness.batch_groups
        limit = self.filter_groups_max_batches * per_batch
        if limit and self.filtered_in_a_row >= limit:
            raise EndlessFiltering(
                f"algorithm.filter_groups: {self.filtered_in_a_row} groups in a row were dropped because all of their rewards "
                f"were equal (the last one's: every reward {value:g}), so the batch never fills (the policy always solves or "
                f"always fails these prompts, or the reward does not vary). Stopping at "
                f"algorithm.filter_groups_max_batches={self.filter_groups_max_batches} x {per_batch} groups per batch "
                f"(trainer.prompts_per_step); raise it (0 = no limit), change the data or the reward, "
                f"or set algorithm.filter_groups=false")
