"""Checkpoint and resume of a run's pipeline (`Pipeline.save`, `Pipeline.restore`).

A checkpoint holds the trainer's state, the run's counters (`state.json`) and what was in flight
(`async_state.msgpack`, `asyncrl/rollout/resume.py`). A resume loads them, labels the checkpoint's
weights above every version published before (`_resume_versions`: versions never go back) and puts the
work in flight back: queued groups into the queue, running groups continued from their saved tokens.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import TYPE_CHECKING

from asyncrl.config import ConfigError
from asyncrl.rollout.resume import capture, read_async_state, reinstate, write_async_state
from asyncrl.run_dir import check_own_tree, checkpoint_dir, latest_checkpoint, prune_checkpoints, read_published, write_state
from asyncrl.trajectory_queue import response_length
from transfer_queue import SampleMeta

if TYPE_CHECKING:
    from asyncrl.controller import Pipeline


class PipelineCheckpoint:
    """The checkpoint / resume verbs of `asyncrl.controller.Pipeline` (its state lives there)."""

    async def save(self: Pipeline) -> None:
        ckpt = checkpoint_dir(self.run_dir, self.step)
        ckpt.mkdir(parents=True, exist_ok=True)
        await self.trainer.save(str(ckpt / "trainer"))
        await self.queue.checkpointed()
        # the queued groups (in-process queue) and every group in flight, continued on resume; from
        # here to write_state no await: the counters below describe exactly what it holds
        # with Ray the records' arrays are in the actors' planes: the controller does not read them
        work = await capture(self.parts.fleets.answering(), self.rollouter, self.queue, keep_arrays=not self.cfg.ray.enabled)
        state = self.staleness.state_dict()
        write_async_state(ckpt, work)
        write_state(
            ckpt,
            {
                "step": self.step,
                "in_flight_samples": sum(g.group_size - len(g.finished) for g in work.groups),
                "lengths": self.lengths.state_dict(),
                "resume_counts": dict(self.resume_counts),
                "failover": dict(self.failover),
                "stale_before_resume": self.stale_before_resume,
                "version_offset": self.version_offset,
                "staleness": state,
                "prompt_position": self.parts.prompts.position,
                "trained_samples": self.trained_samples,
                "trained_tokens": self.trained_tokens,
                "curve": self.curve,
                "staleness_hist": dict(self.staleness_hist),
                "bad_steps": self.bad_steps,
                "wall_s": self.wall_before + time.time() - self.t_start,
            },
        )
        prune_checkpoints(self.run_dir, self.cfg.trainer.keep_checkpoints)

    async def restore(self: Pipeline) -> bool:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return False
        check_own_tree(ckpt, "resume")  # another user's files are not read at all
        from asyncrl.trainer.ckpt_format import CheckpointFormatError, verify

        try:  # one line before the trainer ranks read it (a rank's error reaches here in a traceback)
            verify(ckpt / "trainer")
        except CheckpointFormatError as e:
            raise ConfigError(f"resume: {e}") from None
        state = json.loads((ckpt / "state.json").read_text())
        await self.trainer.load(str(ckpt / "trainer"))
        self.step = state["step"]
        self.version_offset = int(state.get("version_offset", 0))  # absent in checkpoints written before it was kept
        self.staleness.load_state_dict(state["staleness"])
        await self._resume_versions()
        self.parts.prompts.restore(state["prompt_position"])
        self.trained_samples, self.trained_tokens = state["trained_samples"], state["trained_tokens"]
        self.curve = [tuple(p) for p in state["curve"]]
        self.staleness_hist = Counter({int(k): v for k, v in state["staleness_hist"].items()})
        self.bad_steps = state.get("bad_steps", 0)  # absent in checkpoints written before it was counted
        self.lengths.load_state_dict(state.get("lengths", {}))
        self.resume_counts = Counter({k: int(v) for k, v in state.get("resume_counts", {}).items()})
        self.failover = Counter({k: int(v) for k, v in state.get("failover", {}).items()})
        self.stale_before_resume = int(state.get("stale_before_resume", 0))
        self.wall_before = state["wall_s"]
        work = read_async_state(ckpt)
        if work is None:  # written before in-flight work was kept: it was generated again from the prompts
            self.lengths.add_unmeasured("redone", state.get("in_flight_samples", 0))
            return True
        counts = await reinstate(work, rollouter=self.rollouter, queue=self.queue)
        if not self.queue.ack_at_checkpoint:  # what the in-process queue holds again was accepted, and is queued
            self.staleness.accepted = self.staleness.taken + counts.pop("queued_groups")
        counts.pop("queued_groups", None)
        self.resume_counts.update(counts)
        return True

    def _resumed_sample(self: Pipeline, fate: str, record: SampleMeta) -> None:
        """A sample of a group taken back from a checkpoint ended: `continued` from its saved tokens or
        `redone` from its prompt; counted, and a line in `resumed_samples.jsonl`."""
        self.resume_counts[fate] += 1
        if fate == "redone":
            self.lengths.add("redone", [response_length(record)])
        if self._resumed_audit is None:
            self._resumed_audit = (self.run_dir / "resumed_samples.jsonl").open("a")
        m = record.meta
        self._resumed_audit.write(json.dumps({
            "step": self.step, "uid": record.uid, "fate": fate, "response_length": response_length(record),
            "resumed_tokens": m["meta"].get("resumed_tokens", 0), "resumed_max_version": m["meta"].get("resumed_max_version", -1),
            "min_version": m["min_version"], "max_version": m["max_version"]}) + "\n")
        self._resumed_audit.flush()

    async def _resume_versions(self: Pipeline) -> None:
        """Versions never go back. A crash after the checkpoint loses the weights of the versions
        published since, not the samples they generated (a durable queue keeps them, tagged with
        those versions). So the checkpoint's weights are published as a version above every one
        published before (`published_version.json`): no version names two sets of weights. Staleness
        is then measured along the run's lineage (`StalenessManager.resumed`): a sample keeps its true
        age, the trainer steps between the weights that generated it and the trainer's. With a
        durable queue the groups it still holds count as accepted and queued (they were accepted
        after the checkpoint), so admission does not generate that many again.

        Trace (B = 4, eta 4, checkpoint at version 10, versions 11..13 published before the kill):
            resume: step 10, the checkpoint's weights published as version 14 (lineage [(14, 10)])
            queued: a sample of version 9 is 1 old, one of version 12 is 2 old (2 lost steps past 10)
            the next step trains as version 15: they are 2 and 3 old
        """
        published = read_published(self.run_dir)
        sent = self.trainer.published  # a trainer taken back (`ray.detached`) may have sent this very version
        label = self.step + self.version_offset
        if published > label or sent >= label:  # versions were published after the checkpoint: label its weights above them
            above = max(published, sent) + 1
            self.staleness.resumed(above, weights_of=label)
            self.version_offset = above - self.step
        if self.queue.ack_at_checkpoint:  # what the durable queue holds was accepted, and is queued
            resident = (await self.queue.depth())["resident"] // self.n
            self.staleness.accepted = self.staleness.taken + resident
