"""The pipeline loop of a run, for every mode. Modes differ only in the admission rule.

This process decides and carries metadata only. Bulk bytes take the shortest path: a
trajectory's arrays are written once by the server host that finished it and read by each
trainer rank for its own rows; weights go from trainer rank 0 to every server's receiver.

    prompts ─> Rollouter ──free slot, acquire()──> StalenessManager (admission: eta by mode)
                  │  group_size samples per prompt ─> Router ─> a server's host (its process; with Ray a
                  │      ServerActor behind its RemoteServer proxy): AgentLoop + reward, arrays written
                  │      once to that process's data plane
                  │  <── one queue record per sample (metadata + handles, ~1 KiB)
                  v
              TrajectoryQueue (TransferQueue metadata: groups, versions, leases, acks)
                  │  get(B whole groups oldest first, staleness <= eta at the trainer's step; stale ones dropped, counted;
                  │      in order: none newer than the oldest group still running, StalenessManager.takeable_version())
                  v
              trainer loop: advantages (rewards, group ids) ─> BatchPlan (handles + one advantage each)
                  │  ─> every rank reads its rows from the storage units, trains (FSDP2)
                  │  every k steps: FleetManager.publish(version = step) ─> the weight plane
                  │      (checkpoint_engine, `weights:`): trainer rank 0's Sender ─> every routed server's Receiver: pause(update_mode), load as buckets land,
                  │         drop KV / prefix cache, confirm, resume; returns once all loaded; then, off the trainer's path (every
                  │         `weights.parity_every` publishes), the parity probe: servers and trainer score one fixed sequence; a
                  │         server off by more than `weights.parity_tol` stops the run (`watch_parity`) or is re-synced
                  v
              StalenessManager.set_version ─> admits more groups

Loops and what unblocks them:
- rollout loop (`Rollouter.run`): waits for a free fleet slot (`rollout.max_running_samples`;
  a finished sample unblocks it), then in `acquire()` until `(eta + version + 1) * B >
  accepted + running` and, in `fully_async`, groups in flight plus queued are under the pace's
  limit (`asyncrl/admission.py`); a published version, a batch taken by the trainer or a
  dropped group unblocks it. Its groups run
  concurrently; a finished group is put into the queue (put waits while the queue is full).
- trainer loop (`Pipeline._train_loop`): waits in `TrajectoryQueue.get` for B whole groups,
  taken oldest version first; a finished group unblocks it. In order it also waits while a
  group older than those it would take is still running (a newer group is taken only when
  no older one runs or is queued); that group's finish unblocks it. After each step it acks
  (or, with a durable queue, holds the ack until the checkpoint), publishes every k steps,
  evaluates every `trainer.eval_every` steps and checkpoints every `trainer.save_every` steps.
Modes (eta, k, order): `sync` 0, 1, in order (generate B groups with version v, train,
publish v + 1); `one_step_off` 1, 1, in order (batch t + 1 generates with weights t while
batch t trains: step t trains the groups of version t - 1, each exactly one version old);
`fully_async` trainer.max_staleness, trainer.publish_every, ready first (the oldest ready
groups; a group still running when it would exceed eta is dropped, counted). The run stops
when either loop raises (errors propagate) or after `trainer.total_steps`.
A publish waits for every routed server to *load* the version (version 0 included, before the
first evaluation), and the `FleetManager` owns which servers those are: one that misses a
publish is taken out of routing and re-synced; a restarted one is synced before it takes work.
- health loop (`FleetManager.watch`): every `rollout.health_interval_s` it probes each routed
  server; a dead or hung one (no answer in `rollout.health_timeout_s`) is killed and restarted,
  its samples move to other servers (`FleetManager.watch_parity`: waits for a failed parity check that
  stops the run). A step with a non-finite gradient is skipped (`bad_steps`); `trainer.max_bad_steps` in a row stop it.
Checkpoints (`save`, every `trainer.save_every` steps, in the trainer loop): the trainer's state, then
what is in flight (`asyncrl/rollout/resume.py`): the groups the in-process queue holds, with their
arrays, and every running group with what each sample has generated so far (each server's
`partial_samples`); a resume puts the first back into the queue and continues the others from their
saved tokens (partial rollouts), so nothing queued or half generated is generated again.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.launch import Components
from asyncrl.lengths import LengthBias
from asyncrl.metrics import MetricsLogger, idle_ratio
from asyncrl.observe.loop_lag import LoopLag
from asyncrl.observe.reporter import StatusReporter
from asyncrl.pipeline_checkpoint import PipelineCheckpoint
from asyncrl.progress import Progress
from asyncrl.rollout.parity import ParityCheck, vocab_bound
from asyncrl.rollout.resume import run_group_moving, run_moving
from asyncrl.rollout.rollouter import Rollouter
from asyncrl.rollout.shaping import OverlongShaping, overlong_metrics
from asyncrl.run_dir import plot_curve, write_published
from asyncrl.run_state import PipelineSource
from asyncrl.staleness import StalenessManager
from asyncrl.trainer.calls import AsyncTrainer
from asyncrl.trajectory_queue import TrajectoryQueue, response_length, reward, reward_failed
from transfer_queue import SampleMeta


class Pipeline(PipelineCheckpoint):
    def __init__(self, cfg: Config, parts: Components, run_dir: Path, metrics: MetricsLogger) -> None:
        self.cfg, self.parts, self.run_dir, self.metrics = cfg, parts, run_dir, metrics
        self.B, self.n = cfg.trainer.prompts_per_step, cfg.rollout.group_size
        rule = cfg.trainer.rule
        self.publish_every = rule.publish_every
        self.staleness = StalenessManager.for_rule(rule, batch_groups=self.B)
        # one lease holder name per run: a resumed run takes back at once what it had leased before it died
        self.lengths = LengthBias()
        """Response lengths of trained, dropped and redone samples (`summary.json` `lengths`)."""
        self.stale_before_resume = 0
        """Records dropped as stale that were generated before the run's last resume (what a restart cost)."""
        self.queue = TrajectoryQueue(cfg.queue, self.staleness, storage=parts.storage,
                                     consumer_id=f"{socket.gethostname()}:{run_dir.name}",
                                     token_level=cfg.trainer.staleness_level == "token", on_stale=self._stale_dropped)
        self.trainer = AsyncTrainer(parts.trainer)
        self.parity = ParityCheck.from_config(cfg.weights, cfg.model.dtype, vocab_bound(parts.tokenizer, parts.model_path), cfg.rollout)
        """The weight-parity probe after publishes (`weights.parity_*`; the `FleetManager` runs it)."""
        self.rollouter = Rollouter(
            run_sample=self._run_sample, prompts=parts.prompts, staleness=self.staleness, sink=self.queue.put,
            run_group=self._run_group if cfg.ray.enabled and cfg.rollout.group_affinity else None,
            discard=self.queue.discard, group_size=self.n, max_running_samples=cfg.rollout.max_running_samples,
            filter_groups=cfg.algorithm.filter_groups, filter_groups_max_batches=cfg.algorithm.filter_groups_max_batches,
            shaping=OverlongShaping.from_config(cfg), lengths=self.lengths, on_resumed=self._resumed_sample,
            on_group_end=(lambda gid: self.parts.router.end_session(gid)) if cfg.rollout.group_affinity else None,
        )
        self.autoscaler = None
        """`rollout.autoscale.enabled`: the rule that sizes the `main` fleet (`asyncrl/rollout/autoscale.py`)."""
        if cfg.rollout.autoscale.enabled:
            from asyncrl.rollout.autoscale import Autoscaler

            self.autoscaler = Autoscaler(cfg.rollout.autoscale, cfg.rollout.num_servers)
        self.control_rejected = 0
        """Control requests (`asyncrl scale`) that were not valid requests: counted, logged, not applied."""
        self.loop_lag = LoopLag()
        """The event loop's lag, per step in metrics.jsonl (`controller/loop_lag_ms_*`)."""
        self.failover: Counter[str] = Counter()
        """Samples whose server died under them: `continued` from its snapshot or `redone` from the
        prompt, and `tokens_kept` (the snapshots' tokens); records whose producer died or was cut off
        after they were queued, dropped untrained (`unreadable`, the queue's drop cause too); summary.json
        `failover`."""
        self.resume_counts: Counter[str] = Counter()
        """What resumes did with the work in flight at their checkpoints (`asyncrl/rollout/resume.py`;
        `continued` and `redone` as the resumed samples end); summary.json `resume`."""
        self._resumed_audit: Any = None
        """`resumed_samples.jsonl`: one line per sample of a resumed group as it ends (opened at the first)."""
        self.step = 0
        self.version_offset = 0
        """`version` - `step`: 0 until a resume finds versions published after its checkpoint (see `restore`)."""
        self.trained_samples = 0
        self.trained_tokens = 0
        self.curve: list[tuple[int, float]] = []
        self.staleness_hist: Counter[int] = Counter()
        self.bad_steps = 0
        """Trainer steps that skipped a mini-batch for a non-finite gradient (`trainer.max_bad_steps` in a row stop the run)."""
        self.mismatch: dict[str, float] = {}
        """The latest step's `mismatch/*` metrics without the prefix, and `step` (`asyncrl status`' `mismatch` block)."""
        self.wait_s = 0.0
        self.wall_before = 0.0  # seconds spent in earlier (resumed) segments of this run
        self.t_start = time.time()
        self._tokens_at_start = 0
        self._audit = (run_dir / "trained_uids.jsonl").open("a")
        """One line per step: the uids trained on (re-done steps after a resume appear again)."""

    def _stale_dropped(self, records: list[SampleMeta]) -> None:
        """The queue dropped these as too stale: their lengths, and whether a restart made them so."""
        self.lengths.add("dropped_stale", (response_length(s) for s in records))
        if self.staleness.lineage:
            self.stale_before_resume += sum(s.version < self.staleness.lineage[-1][0] for s in records)

    @property
    def version(self) -> int:
        """The policy version of the trainer's current weights (the step, plus a resume's offset)."""
        return self.step + self.version_offset

    # ---- verbs ----------------------------------------------------------------
    async def publish(self) -> dict[str, float]:
        """Have the trainer send its weights to every routed server as `version`; returns once all
        of them loaded it (or were taken out and are being re-synced); admission then moves on."""
        m = await self.parts.fleets.publish(self.version)
        write_published(self.run_dir, self.version)
        await self.staleness.set_version(self.version)
        return m

    async def _run_sample(self, sample: Any, resume: Any = None) -> SampleMeta:
        """One sample on the server the router picks (`resume`: continued from a checkpoint); a server
        that dies under it hands it on with its last snapshot (`run_moving`), counted in `failover`."""
        session = sample.group_id if self.cfg.rollout.group_affinity else None
        record, fate = await run_moving(self.parts.router, sample, resume, free=self.parts.storage.free, session_id=session)
        self._count_fate(record, fate)
        return record

    async def _run_group(self, samples: list[Any]) -> list[SampleMeta]:
        """A new group's samples in one call to the server the router picks (`run_group_moving`); a server that
        dies under them hands each on alone, counted in `failover` as `_run_sample` counts it. Ray fleets under
        `rollout.group_affinity` (the group goes to one server anyway), where a call per sample was most of the
        controller's cost (`asyncrl bench controller --ray`); an embedded server's samples are coroutines of
        this process either way."""
        session = samples[0].group_id if self.cfg.rollout.group_affinity else None
        out = await run_group_moving(self.parts.router, samples, free=self.parts.storage.free, session_id=session)
        for record, fate in out:
            self._count_fate(record, fate)
        return [record for record, _ in out]

    def _count_fate(self, record: SampleMeta, fate: str | None) -> None:
        if fate is not None:
            used = int(record.meta.get("meta", {}).get("resumed_tokens", 0))
            self.failover[fate] += 1
            self.failover["tokens_kept"] += used if fate == "continued" else 0
            if fate == "redone":
                self.lengths.add("redone", [response_length(record)])

    async def evaluate(self) -> dict[str, float]:
        router = self.parts.router
        results = await asyncio.gather(*(router.call(lambda host, s=s: host.run_eval(s)) for s in self.parts.eval_samples))
        n = len(results)
        out = {"eval/reward": sum(r["reward"] for r in results) / n}
        for key in sorted({k for r in results for k, v in r["reward_info"].items() if isinstance(v, (int, float))}):
            out[f"eval/{key}"] = sum(float(r["reward_info"].get(key, 0.0)) for r in results) / n
        self.curve.append((self.step, out["eval/reward"]))
        self._log_generations(results)
        return out

    def _log_generations(self, results: list[dict[str, Any]]) -> None:
        """The first `logging.num_generations` evaluated samples (the same prompts every time) -> generations.jsonl / MLflow."""
        from asyncrl.metrics import Generation
        from asyncrl.rollout.host import clip_text

        k, tok = self.cfg.logging.num_generations, self.parts.tokenizer
        # the prompt exactly as the model saw it, chat-template markup (special tokens) included
        render = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok is not None else (lambda ids: " ".join(map(str, ids)))
        rows = [Generation(step=self.step, version=self.staleness.version, uid=s.uid, prompt=clip_text(render(list(s.prompt_ids))),
                           response=r["response"], answer=clip_text(str(s.answer)), reward=r["reward"],
                           finish_reason=r["finish_reason"], response_length=r["response_length"])
                for s, r in zip(self.parts.eval_samples[:k], results[:k])]
        self.metrics.generations(self.step, rows)

    def _batch_metrics(self, groups: list[list[SampleMeta]]) -> dict[str, float]:
        recs = [s for g in groups for s in g]
        lens = [response_length(s) for s in recs]
        self.lengths.add("trained", lens)
        stale = [self.staleness.staleness(s.meta["min_version"], self.version) for s in recs]
        self.staleness_hist.update(stale)
        return {
            "rollout/reward": sum(reward(s) for s in recs) / len(recs),
            "rollout/response_length": sum(lens) / len(lens),
            "rollout/truncated": sum(s.meta["finish_reason"] == "length" for s in recs) / len(recs),
            "rollout/reward_failed": sum(reward_failed(s) for s in recs),
            "rollout/mixed_version": sum(s.meta["min_version"] != s.meta["max_version"] for s in recs) / len(recs),
            "staleness/mean": sum(stale) / len(stale),
            "staleness/max": max(stale),
            **{f"staleness/hist_{k}": v for k, v in sorted(Counter(stale).items())},
            **overlong_metrics(recs),
        }

    def _pipeline_metrics(self) -> dict[str, float]:
        wall = max(time.time() - self.t_start, 1e-9)
        return {
            "throughput/generated_tokens_per_s": self.rollouter.generated_tokens / wall,
            "throughput/trained_tokens_per_s": (self.trained_tokens - self._tokens_at_start) / wall,
            "trainer/idle_ratio": idle_ratio(self.wait_s, wall),
            "rollout/idle_ratio": idle_ratio(self.rollouter.idle_seconds(), wall),
            "trained_samples": self.trained_samples,
            "version": self.staleness.version,
            **{f"drops/{k}": v for k, v in self.staleness.dropped.items()},
        }

    # ---- loops ------------------------------------------------------------------
    async def _train_loop(self, progress: Progress) -> None:
        cfg = self.cfg
        while self.step < cfg.trainer.total_steps:
            t_wait = time.time()
            handle, groups = await self.queue.get(self.B, self.n, self.version)
            t_batch = time.time()
            self.wait_s += t_batch - t_wait
            await self.staleness.took(len(groups))
            m = self._batch_metrics(groups)  # staleness measured at the step that trains on them
            plan, n_tokens = self.parts.make_plan(groups)
            plan.version, plan.lineage = self.version, self.staleness.lineage  # what token versions are aged against
            stats = await self.trainer.train(plan)
            unreadable: dict[str, str] = stats.pop("unreadable", None) or {}
            if unreadable:  # their producer did not answer (its host died or is cut off): not trained, counted
                await self.queue.drop_unreadable(handle, set(unreadable))
                self.failover["unreadable"] += len(unreadable)
                print(f"asyncrl: step {self.step + 1}: {len(unreadable)} records unreadable and dropped "
                      f"({sorted(set(unreadable.values()))[0]})", flush=True)
            m["time/train_s"] = time.time() - t_batch
            m["time/wait_rollout_s"] = t_batch - t_wait
            self.step += 1
            self.bad_steps += int(stats.get("bad_step", 0))
            self.mismatch = {"step": self.step, **{k.removeprefix("mismatch/"): v for k, v in stats.items() if k.startswith("mismatch/")}}
            self.trained_samples += sum(len(g) for g in groups) - len(unreadable)
            self.trained_tokens += n_tokens
            await self.queue.trained(handle)
            self._audit.write(json.dumps({"step": self.step, "uids": [s.uid for g in groups for s in g if s.uid not in unreadable]}) + "\n")
            self._audit.flush()
            last = self.step == cfg.trainer.total_steps
            if self.step % self.publish_every == 0 or last:
                m.update(await self.publish())
            m.update({f"train/{k}": v for k, v in stats.items()})
            q = await self.queue.depth()
            m.update({"queue/depth": q["ready"], "queue/resident": q["resident"], **self._pipeline_metrics()})
            if hasattr(self.parts.fleets, "metrics"):
                m.update(self.parts.fleets.metrics())
            if self.step % cfg.trainer.eval_every == 0 or last:
                m.update(await self.evaluate())
            m["admission/limit"] = self.staleness.admission_limit()
            m["admission/in_flight_queued"] = self.staleness.running + self.staleness.queued
            m.update(self.loop_lag.take())
            await self.staleness.step_done(time.time() - t_batch, t_batch - t_wait)
            self.metrics.log(self.step, m)
            progress.update(self.step, m)
            target_hit = bool(cfg.trainer.target_reward and self.curve and self.curve[-1][0] == self.step and self.curve[-1][1] >= cfg.trainer.target_reward)
            if (cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0) or last or target_hit:
                await self.save()
            if target_hit:
                break

    async def run(self) -> dict[str, Any]:
        _dump_tasks_on_sigusr1()
        self.t_start = time.time()
        self._tokens_at_start = self.trained_tokens
        await self.parts.start()  # the fleets: Ray actors (placed and loaded) or this process's servers
        await self.parts.fleets.attach_weights(self.trainer, self.cfg.weights, self.cfg.rollout.update_mode, parity=self.parity)
        resumed = self.cfg.resume and await self.restore()
        self._tokens_at_start = self.trained_tokens
        await self.publish()  # servers start from the trainer's exact weights at this version
        if not resumed:
            skipped = {f"data/skipped_{split}_{why}": n for split, rows in self._skipped_rows().items() for why, n in rows.items()}
            self.metrics.log(0, {**await self.evaluate(), **skipped})
        progress = Progress(self.cfg.trainer.total_steps, start=self.step, enabled=self.cfg.logging.progress)
        progress.update(self.step, {"eval/reward": self.curve[-1][1]} if self.curve else {})
        roll = asyncio.create_task(self.rollouter.run())
        train = asyncio.create_task(self._train_loop(progress))
        health = asyncio.create_task(self.parts.fleets.watch(self.cfg.rollout.health_interval_s))
        leases = asyncio.create_task(self.queue.keep_leases())
        control = asyncio.create_task(self._control_loop())
        loops = {roll, train, health, leases, control, asyncio.create_task(self.parts.fleets.watch_parity()),
                 asyncio.create_task(self.loop_lag.run())}
        if self.autoscaler is not None:
            loops.add(asyncio.create_task(self._autoscale_loop()))
        if self.cfg.ray.detached:  # the actors outlive this process: tell them it is there
            loops.add(asyncio.create_task(self._keepalive(self.cfg.ray.orphan_timeout_s / 4)))
        status = StatusReporter(PipelineSource(self))  # observers read a typed run state, not the pipeline
        reporter = asyncio.create_task(status.run())
        try:
            # the status reporter too: an observer that died would leave `asyncrl status` reading "dead" on a live run
            done, _ = await asyncio.wait(loops | {reporter}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # re-raise the error of a loop that died
        finally:
            stuck: set[asyncio.Task] = loops | {reporter}
            for _ in range(3):  # a cancel can be lost (a wait_for racing it); ask again rather than hang
                for t in stuck:
                    t.cancel()
                _, stuck = await asyncio.wait(stuck, timeout=STOP_TIMEOUT_S / 3)
                if not stuck:
                    break
            for t in stuck:
                print(f"asyncrl: {t.get_coro()!r} did not stop within {STOP_TIMEOUT_S} s", file=sys.stderr)
            self._log_fleet_events()
            await status.final()  # the end state (finished, or failed with the error in flight)
            progress.close()
            await self.queue.close()
            self._audit.close()
            if self._resumed_audit is not None:
                self._resumed_audit.close()
        return self.summary(resumed)

    async def _control_loop(self) -> None:
        """Requests from outside the run (`asyncrl scale`, `run_control.py`), applied in order about every
        `CONTROL_POLL_S`: each is answered in the run directory (and under the run's Redis name when the queue is
        in Redis) with what was done, or why it was refused. A malformed one is counted and logged."""
        from asyncrl import run_control

        redis = run_control.RedisControl(self.cfg.queue.redis_url, self.run_dir.name) if self.cfg.queue.metadata == "redis" else None
        follow = self.cfg.rollout.follow_cluster
        if follow:
            self.parts.fleets.capacity = self._cluster_room
        polls = 0
        try:
            while True:
                await asyncio.sleep(CONTROL_POLL_S)
                polls += 1
                if follow and polls % FOLLOW_EVERY == 0:
                    await self._follow_cluster()
                got = [(r, why, None) for r, why in run_control.take(self.run_dir)]
                if redis is not None:
                    got += [(r, why, redis) for r, why in await asyncio.to_thread(redis.take)]
                self._log_fleet_events()
                for req, why, where in got:
                    if req is None:
                        self.control_rejected += 1
                        print(f"asyncrl: control request refused: {why}", file=sys.stderr, flush=True)
                        continue
                    outcome = await self._apply(req)
                    await asyncio.to_thread(run_control.answer, self.run_dir, req, outcome)
                    if where is not None:
                        await asyncio.to_thread(where.answer, req, outcome)
        finally:
            if redis is not None:
                redis.close()

    def slots_per_server(self) -> int:
        r = self.cfg.rollout
        return r.autoscale.slots_per_server or (r.cost_model.max_concurrency if r.backend == "cost_model" else r.max_batch_size)

    async def _autoscale_loop(self) -> None:
        """`rollout.autoscale`: sample the servers' slot use about every second; at the end of each
        `interval_s` window hand it and the trainer's wait to the `Autoscaler`, and resize `main` as it
        decides (`asyncrl/rollout/autoscale.py`). Its verdict is in the fleet's status (`autoscale`)."""
        from asyncrl.rollout.autoscale import Window, split_from_rates

        assert self.autoscaler is not None
        cfg, fleets, slots = self.cfg.rollout.autoscale, self.parts.fleets, self.slots_per_server()
        while True:
            t0, wait0, uses = time.time(), self.wait_s, []
            gen0, trained0 = self.rollouter.generated_tokens, self.trained_tokens
            while time.time() - t0 < cfg.interval_s:
                await asyncio.sleep(min(1.0, cfg.interval_s))
                routed = [s for s, f in zip(fleets.router.servers, fleets.router.fleets) if f == "main"]
                busy = [n for n, f in zip(fleets.router.in_flight, fleets.router.fleets) if f == "main"]
                if routed:
                    uses.append(min(1.0, sum(busy) / (len(routed) * slots)))
            servers = fleets.size().get("main", 0)
            window = Window(seconds=time.time() - t0, trainer_wait_s=self.wait_s - wait0,
                            slot_use=sum(uses) / len(uses) if uses else 0.0, servers=servers)
            want = self.autoscaler.decide(window, time.time())
            fleets.autoscale = {**self.autoscaler.last, **split_from_rates(
                window, generated=self.rollouter.generated_tokens - gen0, trained=self.trained_tokens - trained0)}
            with (self.run_dir / "autoscale.jsonl").open("a") as f:  # one line per window: `asyncrl bench elastic --autoscale`
                f.write(json.dumps({"time": round(t0, 3), "step": self.step, "seconds": round(window.seconds, 3),
                                    **fleets.autoscale, "decided": want}) + "\n")
            if want is not None:
                print(f"asyncrl: autoscale: {self.autoscaler.last['bottleneck']} is the bottleneck "
                      f"(trainer idle {window.trainer_idle:.2f}, server slots idle {window.rollout_idle:.2f}): "
                      f"main {servers} -> {want} servers", flush=True)
                try:
                    await fleets.resize("main", want, drain_timeout_s=self.cfg.rollout.drain_timeout_s)
                except ValueError as exc:  # refused (a fleet removed meanwhile): the next window decides again
                    print(f"asyncrl: autoscale: resize refused: {exc}", file=sys.stderr, flush=True)

    def _fleet_summary(self) -> dict[str, Any]:
        """summary.json `fleet`: routed servers per fleet at the end, and every change by kind."""
        fleets = self.parts.fleets
        if not hasattr(fleets, "metrics"):
            return {}
        m = fleets.metrics()
        return {"size": fleets.size(), "joins_by_source": dict(fleets.joins),
                "changes": {k[6:]: int(v) for k, v in m.items() if k[6:] in ("joins", "drains", "preempts", "restarts")},
                "control_rejected": self.control_rejected}

    def _log_fleet_events(self) -> None:
        """The fleets' joins, drains, preemptions and restarts since the last call -> `fleet_events.jsonl`
        (one line each; metrics.jsonl has their counts per step, `fleet/*`)."""
        take = getattr(self.parts.fleets, "take_events", None)
        events = take() if take is not None else []
        if events:
            with (self.run_dir / "fleet_events.jsonl").open("a") as f:
                f.writelines(json.dumps({"step": self.step, **e}) + "\n" for e in events)

    def _cluster_room(self) -> dict[str, int]:
        """`rollout.follow_cluster`: servers of `main` the Ray cluster's rollout nodes hold room for now."""
        import ray

        key = self.cfg.rollout.follow_cluster
        total = float(ray.cluster_resources().get(key, 0.0))
        return {"main": int(total / self.cfg.rollout.ray_resources[key] + 1e-9)}

    async def _follow_cluster(self) -> None:
        """`rollout.follow_cluster`: `main` resized to the room the cluster's rollout nodes hold (at least 1;
        with `rollout.autoscale`, that room caps its range instead)."""
        room = max(1, (await asyncio.to_thread(self._cluster_room))["main"])
        fleets = self.parts.fleets
        if self.autoscaler is not None:
            self.autoscaler.max = room
            if fleets.size().get("main", 0) <= room:
                return
        have = len(fleets.fleets["main"].servers)
        if have != room or fleets.targets.get("main") not in (None, room):
            if have != room:  # else only the target moves (a vanished node's server already left as a preemption)
                print(f"asyncrl: the cluster's {self.cfg.rollout.follow_cluster} nodes hold room for {room} servers: "
                      f"main {have} -> {room}", flush=True)
            try:
                await fleets.resize("main", room, drain_timeout_s=self.cfg.rollout.drain_timeout_s)
            except ValueError as exc:
                print(f"asyncrl: follow_cluster: resize refused: {exc}", file=sys.stderr, flush=True)

    async def _apply(self, req: Any) -> dict[str, Any]:
        """One `ScaleRequest`: the fleet resized (returns when its new servers are up and joining, and the
        ones taken away drained), or refused with why."""
        fleets = self.parts.fleets
        current = len(fleets.fleets[req.fleet].servers) if req.fleet in fleets.fleets else 0
        try:
            out = await fleets.resize(req.fleet, req.target(current), drain_timeout_s=self.cfg.rollout.drain_timeout_s)
        except (ValueError, RuntimeError) as exc:
            print(f"asyncrl: scale {req.fleet}: refused: {exc}", file=sys.stderr, flush=True)
            return {"ok": False, "error": str(exc)}
        print(f"asyncrl: scale {req.fleet}: {out['from']} -> {out['to']} servers", flush=True)
        return {"ok": True, **out}

    async def _keepalive(self, every_s: float) -> None:
        """`ray.detached`: touch every server each `every_s` (their orphan watch; the trainer's ranks are
        touched by their group, `TrainerGroup.keep_alive`)."""
        from asyncrl.rollout.router import ServerDied

        while True:
            await asyncio.sleep(every_s)
            done = await asyncio.gather(*(s.touch() for s in self.parts.fleets.servers if hasattr(s, "touch")), return_exceptions=True)
            for res in done:
                if isinstance(res, BaseException) and not isinstance(res, ServerDied):  # a dead server is the health loop's
                    raise res

    def _skipped_rows(self) -> dict[str, dict[str, int]]:
        """Data rows skipped at load, by split and reason (none for a pipeline built without a task: benchmarks)."""
        task = self.parts.task
        return {} if task is None else {"train": dict(task.train.skipped), "eval": dict(task.eval.skipped)}

    def summary(self, resumed: bool) -> dict[str, Any]:
        plot_curve(self.run_dir, self.curve, f"{self.run_dir.name} ({self.cfg.trainer.mode})")
        pm = self._pipeline_metrics()
        return {
            "mode": self.cfg.trainer.mode,
            "steps": self.step,
            "trained_samples": self.trained_samples,
            "reward_step0": self.curve[0][1] if self.curve else None,
            "final_eval_reward": self.curve[-1][1] if self.curve else None,
            "best_eval_reward": max(r for _, r in self.curve) if self.curve else None,
            "wall_s": round(self.wall_before + time.time() - self.t_start, 1),
            "resumed": bool(resumed),
            "drops": dict(self.staleness.dropped),
            "stale_dropped_from_before_resume": self.stale_before_resume,
            "lengths": self.lengths.summary(),
            "samples_continued": self.resume_counts["continued"],
            "redone": self.lengths.summary().get("redone", {}).get("count", 0),
            "resume": dict(self.resume_counts),
            "failover": dict(self.failover),
            "reward_failures": self.rollouter.reward_failures,
            "fleet": self._fleet_summary(),
            "bad_steps": self.bad_steps,
            "skipped_rows": self._skipped_rows(),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "staleness_mean": round(sum(k * v for k, v in self.staleness_hist.items()) / max(1, sum(self.staleness_hist.values())), 3),
            "trainer_idle_ratio": round(pm["trainer/idle_ratio"], 3),
            "rollout_idle_ratio": round(pm["rollout/idle_ratio"], 3),
            "curve": self.curve,
        }


FOLLOW_EVERY = 3
"""`rollout.follow_cluster`: look at the cluster's rollout nodes every this many control polls."""
CONTROL_POLL_S = 1.0
"""Seconds between two looks for requests from outside the run (`asyncrl scale`)."""
STOP_TIMEOUT_S = 30.0
"""At the end of a run, how long the pipeline's loops get to stop once cancelled."""


def _dump_tasks_on_sigusr1() -> None:
    """`kill -USR1 <controller pid>` prints the stack of every task of the pipeline to stderr
    (where a run that seems stuck is waiting). Main thread only; elsewhere nothing is installed."""
    import signal

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGUSR1, lambda: [t.print_stack(limit=12, file=sys.stderr) for t in asyncio.all_tasks(loop)])
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (tests), or no signals here
        pass
