"""The pipeline loop of a run, for every mode. Modes differ only in the admission rule.

    prompts ─> Rollouter ──acquire()──> StalenessManager (admission: eta by mode)
                  │  group_size AgentLoops per prompt ─> Router ─> rollout servers
                  │  finished group (rewards scored)
                  v
              GroupQueue ──get(B groups; stale ones dropped and counted)
                  │
                  v
              trainer loop: advantages ─> TrainBatch ─> train_step ─> publish(version = step)
                                                                          │ servers.update_weights
                                                                          │ (KV / prefix cache dropped)
                                                                          v
                                                       StalenessManager.set_version ─> admits more groups

Loops and what unblocks them:
- rollout loop (`Rollouter.run`): waits in `acquire()` until `(eta + version + 1) * B >
  accepted + running`; a published version or a dropped group unblocks it.
- trainer loop (`Pipeline._train_loop`): waits in `GroupQueue.get` for B groups; a finished
  group unblocks it. After each step it publishes weights, evaluates every
  `trainer.eval_every` steps and checkpoints every `trainer.save_every` steps.
With eta = 0 (`sync`) the two loops alternate: generate B groups with version v, train,
publish v + 1, generate again. The run stops when either loop raises (errors propagate)
or after `trainer.total_steps`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.launch import Components
from asyncrl.metrics import MetricsLogger
from asyncrl.progress import Progress
from asyncrl.rollout.rollouter import Rollouter
from asyncrl.run_dir import checkpoint_dir, latest_checkpoint, plot_curve, prune_checkpoints, write_state, write_status
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import GroupQueue
from asyncrl.types import Trajectory

ETA_BY_MODE = {"sync": 0, "one_step_off": 1}


class Pipeline:
    def __init__(self, cfg: Config, parts: Components, run_dir: Path, metrics: MetricsLogger) -> None:
        self.cfg, self.parts, self.run_dir, self.metrics = cfg, parts, run_dir, metrics
        self.batch_groups = cfg.trainer.prompts_per_step
        if cfg.trainer.mode not in ETA_BY_MODE:
            raise NotImplementedError(f"trainer.mode={cfg.trainer.mode!r} is not available yet; use sync or one_step_off")
        self.staleness = StalenessManager(batch_groups=self.batch_groups, eta=ETA_BY_MODE[cfg.trainer.mode])
        self.queue = GroupQueue(self.staleness)
        self.rollouter = Rollouter(
            agent=parts.agent,
            llm=parts.router,
            prompts=parts.prompts,
            staleness=self.staleness,
            sink=self.queue.put,
            group_size=cfg.rollout.group_size,
        )
        self.step = 0
        self.trained_samples = 0
        self.curve: list[tuple[int, float]] = []
        self.wall_before = 0.0  # seconds spent in earlier (resumed) segments of this run

    # ---- checkpoint / resume ------------------------------------------------
    def save(self) -> None:
        ckpt = checkpoint_dir(self.run_dir, self.step)
        ckpt.mkdir(parents=True, exist_ok=True)
        self.parts.trainer.save(str(ckpt / "trainer"))
        state = self.staleness.state_dict()
        # groups waiting in the in-process queue die with the process: on resume they are regenerated
        state["accepted"] -= len(self.queue)
        write_state(
            ckpt,
            {
                "step": self.step,
                "staleness": state,
                # prompts of queued groups were handed out but not trained on: hand them out again
                "prompt_position": self.parts.prompts.position - len(self.queue) - self.staleness.running,
                "trained_samples": self.trained_samples,
                "curve": self.curve,
                "wall_s": self.wall_before + time.time() - self.t_start,
            },
        )
        prune_checkpoints(self.run_dir, self.cfg.trainer.keep_checkpoints)

    async def restore(self) -> bool:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return False
        import json

        state = json.loads((ckpt / "state.json").read_text())
        self.parts.trainer.load(str(ckpt / "trainer"))
        self.step = state["step"]
        self.staleness.load_state_dict(state["staleness"])
        self.parts.prompts.restore(state["prompt_position"])
        self.trained_samples = state["trained_samples"]
        self.curve = [tuple(p) for p in state["curve"]]
        self.wall_before = state["wall_s"]
        await self.publish()
        return True

    # ---- verbs ----------------------------------------------------------------
    async def publish(self) -> float:
        """Load the trainer's weights into every server as version `step`; returns seconds."""
        t0 = time.time()
        for server in self.parts.servers:
            await server.update_weights(self.parts.trainer.iter_full_params(), self.step)
        await self.staleness.set_version(self.step)
        return time.time() - t0

    async def evaluate(self) -> dict[str, float]:
        trajs = await asyncio.gather(*(self.parts.eval_agent.run(s, self.parts.router) for s in self.parts.eval_samples))
        n = len(trajs)
        out = {"eval/reward": sum(t.reward for t in trajs) / n}
        for key in sorted({k for t in trajs for k, v in t.reward_info.items() if isinstance(v, (int, float))}):
            out[f"eval/{key}"] = sum(float(t.reward_info.get(key, 0.0)) for t in trajs) / n
        self.curve.append((self.step, out["eval/reward"]))
        return out

    def _batch_metrics(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        trajs = [t for g in groups for t in g]
        lens = [len(t.response_ids) for t in trajs]
        stale = [self.staleness.staleness(t.min_version) for t in trajs]
        return {
            "rollout/reward": sum(t.reward for t in trajs) / len(trajs),
            "rollout/response_length": sum(lens) / len(lens),
            "rollout/truncated": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
            "rollout/reward_failed": sum("failed" in t.reward_info for t in trajs),
            "staleness/mean": sum(stale) / len(stale),
            "staleness/max": max(stale),
        }

    # ---- loops ------------------------------------------------------------------
    async def _train_loop(self, progress: Progress) -> None:
        cfg = self.cfg
        while self.step < cfg.trainer.total_steps:
            t_wait = time.time()
            groups = await self.queue.get(self.batch_groups)
            t_batch = time.time()
            batch_metrics = self._batch_metrics(groups)  # staleness measured at the version that trains on them
            batch, n_tokens = self.parts.make_batch(groups)
            stats = await asyncio.to_thread(self.parts.trainer.train_step, batch)
            t_train = time.time() - t_batch
            self.step += 1
            self.trained_samples += sum(len(g) for g in groups)
            publish_s = await self.publish()
            m = {f"train/{k}": v for k, v in stats.items()}
            m.update(batch_metrics)
            m.update(
                {
                    "time/wait_rollout_s": t_batch - t_wait,
                    "time/train_s": t_train,
                    "time/publish_s": publish_s,
                    "throughput/trained_tokens_per_s": n_tokens / max(t_train, 1e-9),
                    "throughput/generated_tokens_per_s": self.rollouter.generated_tokens / max(time.time() - self.t_start, 1e-9),
                    "queue/depth": len(self.queue),
                    "trained_samples": self.trained_samples,
                    **{f"drops/{k}": v for k, v in self.staleness.dropped.items()},
                }
            )
            last = self.step == cfg.trainer.total_steps
            if self.step % cfg.trainer.eval_every == 0 or last:
                m.update(await self.evaluate())
            self.metrics.log(self.step, m)
            progress.update(self.step, m)
            write_status(self.run_dir, state="running", step=self.step, version=self.staleness.version)
            if (cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0) or last:
                self.save()
            if cfg.trainer.target_reward and self.curve and self.curve[-1][0] == self.step and self.curve[-1][1] >= cfg.trainer.target_reward:
                self.save()
                break

    async def run(self) -> dict[str, Any]:
        self.t_start = time.time()
        resumed = self.cfg.resume and await self.restore()
        if not resumed:
            await self.publish()  # servers start from the trainer's exact weights, version 0
            m = await self.evaluate()
            self.metrics.log(0, m)
        progress = Progress(self.cfg.trainer.total_steps, start=self.step, enabled=self.cfg.logging.progress)
        progress.update(self.step, {"eval/reward": self.curve[-1][1]} if self.curve else {})
        roll = asyncio.create_task(self.rollouter.run())
        train = asyncio.create_task(self._train_loop(progress))
        try:
            done, _ = await asyncio.wait({roll, train}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # re-raise the error of a loop that died
        finally:
            for t in (roll, train):
                t.cancel()
            await asyncio.gather(roll, train, return_exceptions=True)
            progress.close()
        return self.summary(resumed)

    def summary(self, resumed: bool) -> dict[str, Any]:
        plot_curve(self.run_dir, self.curve, f"{self.cfg.trainer.mode}: held-out reward")
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
            "reward_failures": self.rollouter.reward_failures,
            "curve": self.curve,
        }
