"""TrainerEngine: one FSDP2 rank's math, in the rank's process; log-probs, the optimizer step, full weights.

Plain Python on torch.distributed, no Ray: the same class runs in a unit test, under
`torchrun` and inside a rank actor (`TrainerRankActor`, `actor.py`). If no process group exists it starts a
1-rank one (gloo on CPU, nccl on GPU) on a free 127.0.0.1 port, so `fully_shard` always
applies and one code path serves 1 and N ranks.

A step takes this rank's rows of each mini-batch (`train_local`: what a rank of the pipeline
reads from the data plane, see `plan.py`), or the full `TrainBatch` on every rank, which it
cuts the same way (`train_step`: tests, torchrun). Loss normalisers (`num_tokens`,
`num_seqs`) of each mini-batch are all-reduced over the ranks and the rank's loss is scaled
by the world size before FSDP averages gradients, so N ranks take exactly the step one rank
would. The
algorithm is chosen by name from the registries in `advantages.py` / `losses.py` /
`corrections.py`; this file has no per-algorithm branches: the off-policy `Corrector`
declares whether it needs a proximal-policy pass (`needs_proximal`) and returns per-token
weights that multiply the policy loss; the policy loss entry carries its settings and its
aggregation (`PolicyLoss.agg`); the advantage's spec says whether a critic is built (`needs_critic`).

How a step is computed, never what it computes, is set by the speed switches (`trainer.attn_implementation`,
`grad_reduce`, `optimizer_impl`, `compile`, `proximal_forward`; each checked equal to the plain step in
tests/unit/trainer/test_speed_switches.py, measured by `asyncrl bench trainer --speed`). Micro-batches are
cut and packed on the host before their loop, and the loop keeps its sums on the device: it never waits for
the device until the mini-batch's metrics are read.

It does not know about queues, versions beyond its own `step`, or how weights are
published: `iter_full_params` hands full tensors to whoever publishes them.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config import AlgorithmConfig, CriticConfig, TrainerConfig
from asyncrl.trainer.batch import TrainBatch, along_lineage, mask_stale_tokens, token_age_metrics
from asyncrl.trainer.critic import CriticEngine
from asyncrl.trainer.corrections import Corrector
from asyncrl.trainer.lora import LoraSpec
from asyncrl.trainer.mismatch import MismatchStats, rollout_probs_diff
from asyncrl.trainer.step_metrics import MiniBatchSums, merge_minibatch_metrics
from asyncrl.trainer.advantages import advantage_spec
from asyncrl.trainer.losses import POLICY_LOSSES, LossInputs, agg_loss, kl_penalty
from asyncrl.trainer.packing import Packed
from asyncrl.trainer.scoring import Scorer
from asyncrl.trainer.load import load_sharded_model
from asyncrl.trainer.setup import adamw_with_schedule, attention_kernel, clip_and_step, close_process_group, compile_disabled, ensure_process_group, pick_device

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainerEngine:
    """One FSDP2 rank: `compute_logprobs`, `train_step`, `iter_full_params`, `save` / `load`.

        engine = TrainerEngine(path, trainer=cfg.trainer, algorithm=cfg.algorithm)
        batch = batch.replace(proximal_logprobs=engine.compute_logprobs(batch))  # optional: done if the correction needs it
        metrics = engine.train_step(batch)        # one optimizer step; engine.step += 1
        for name, tensor in engine.iter_full_params(): ...
    """

    def __init__(
        self,
        model_path: str,
        *,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        dtype: str = "float32",
        temperature: float = 1.0,
        seed: int = 0,
        critic: CriticConfig | None = None,
        lora: LoraSpec | None = None,
    ) -> None:
        self.policy_loss = POLICY_LOSSES.get(algorithm.loss)  # an unknown name raises, naming algorithm.loss
        self.loss_settings = algorithm.loss_settings()
        """The loss's own constants (`algorithm.loss_args`), checked once, passed to every call."""
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.trainer, self.algorithm, self.temperature = trainer, algorithm, temperature
        self.corrector = Corrector(algorithm)
        self.dtype = DTYPES[dtype]
        if trainer.threads:
            torch.set_num_threads(trainer.threads)
        self.device = pick_device(trainer.device)
        self._owns_process_group = ensure_process_group(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.scorer = Scorer(trainer, temperature, self.device, self.rank, self.world)
        """Forward passes of this rank's rows: micro-batches in step, packing, chunked log-probs (`scoring.py`)."""
        torch.manual_seed(seed)
        self.attn_implementation = attention_kernel(trainer, self.device)
        """transformers' attention kernel of every model of this rank (`trainer.attn_implementation`)."""
        compile_off = compile_disabled()
        if self.attn_implementation == "flex_attention" and compile_off:
            raise ValueError("trainer.attn_implementation=flex_attention needs torch.compile, and TORCH_COMPILE_DISABLE "
                             "is set in this process: unset it, or pick sdpa")
        if trainer.compile and compile_off:
            log.warning("trainer.compile=true does nothing here: TORCH_COMPILE_DISABLE is set in this process")
        if self.attn_implementation == "flex_attention" and self.device.type == "cpu":
            log.warning("trainer.attn_implementation=flex_attention on CPU: log-probs only, a training step raises "
                        "(torch has no CPU backward for flex attention)")
        kernels = dict(attn_implementation=self.attn_implementation, compile=trainer.compile)
        self.model = load_sharded_model(model_path, self.device, self.dtype, trainable=True,
                                        gradient_checkpointing=trainer.gradient_checkpointing, lora=lora, **kernels)
        needs_ref = algorithm.kl_coef > 0 or algorithm.use_kl_in_reward
        self.ref_model = load_sharded_model(model_path, self.device, self.dtype, trainable=False, lora=lora,
                                            adapters_of=self.model, **kernels) if needs_ref else None  # LoRA: the base, adapters off
        self.optimizer, self.scheduler = adamw_with_schedule(self.model, trainer, trainer.lr, trainer.weight_decay)
        self.step = 0
        """Trainer steps taken (one per `train_step`, whatever `trainer.minibatches`)."""
        self.version_offset = 0
        """`version` - `step`: 0, until a resumed run labels the checkpoint's weights with a version above
        every one published before the crash (versions never go back; see `asyncrl/controller.py`)."""
        self.bad_steps = 0
        """Trainer steps in which a mini-batch was skipped for a non-finite gradient norm (see `_count_bad_step`)."""
        self.bad_steps_in_a_row = 0
        self.entropy_coef = algorithm.entropy_coef
        """Weight of the entropy bonus; adapted after each step when `algorithm.entropy_target` > 0 (checkpointed)."""
        self.critic_cfg = critic or CriticConfig()
        needs_critic = advantage_spec(algorithm.advantage).needs_critic
        self.critic: CriticEngine | None = CriticEngine(model_path, engine=self) if needs_critic else None
        """PPO's value model (`algorithm.advantage=gae`): GAE advantages and its own update each mini-batch."""

    @property
    def version(self) -> int:
        """The policy version of the current weights: what tokens' `token_versions` are compared with."""
        return self.step + self.version_offset

    def compute_logprobs(self, batch: TrainBatch) -> Tensor:
        """[B, T] log p(input_ids[b, t] | input_ids[b, :t]) at `temperature` under the current weights (0 at t=0 and padding)."""
        return self.scorer.score(self.model, batch)

    def compute_ref_logprobs(self, batch: TrainBatch) -> Tensor:
        """Same under the frozen reference policy (the initial weights); needs `algorithm.kl_coef > 0`."""
        if self.ref_model is None:
            raise RuntimeError("compute_ref_logprobs: no reference model (algorithm.kl_coef is 0)")
        return self.scorer.score(self.ref_model, batch)

    @torch.no_grad()
    def score_tokens(self, token_ids: list[int]) -> list[float]:
        """Log-probs of `token_ids[1:]` at temperature 1 under the current weights: what a server that
        loaded them must give on the same tokens (the weight-parity probe). Every rank runs it (FSDP
        gathers the parameters); each returns the same list."""
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()

    # ---- training -------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One trainer step over the global batch, given in full to every rank; returns its
        metrics (see `train_local`). Each rank takes its rows of each mini-batch (`plan.py`)."""
        from asyncrl.trainer.plan import minibatch_slices

        parts, real = [], []
        for mb in minibatch_slices(len(batch), self.trainer.minibatches):
            rows = batch[mb]
            parts.append(rows.shard(self.rank, self.world))
            real.append(len(rows.shard_rows(self.world)[self.rank]))
        return self.train_local(parts, real)

    def train_local(self, parts: list[TrainBatch], real_rows: list[int], version: int = -1,
                    lineage: list[list[int]] | None = None) -> dict[str, float]:
        """One trainer step from this rank's rows of each mini-batch (`parts`, padding rows with
        loss mask 0 included; `real_rows` counts the others); every rank calls it together. A sequence
        mean's `num_seqs` counts the rows with a loss token, so padding rows and real rows left without
        one (tool-only, every token too stale) do not dilute it.

        With several mini-batches (`trainer.minibatches`), one optimizer step each. The reference
        and proximal log-probs are computed once, with the step's starting weights, so from the
        second mini-batch on the PPO clip around the proximal policy binds (decoupled PPO's trust
        region). `step` (the version) and the LR schedule advance once per trainer step.
        Metrics: means over mini-batches, `tokens`/`seqs` summed, extremes kept.
        """
        if len(parts) != len(real_rows) or not parts:
            raise ValueError(f"train_local: {len(parts)} parts, {len(real_rows)} row counts")
        if version >= 0:  # the controller's label of the current weights (`BatchPlan.version`)
            self.version_offset = version - self.step
        parts = along_lineage(parts, self.version, lineage or [])  # after a resume: ages along the lineage
        parts = [self._with_fixed_logprobs(p, proximal=i > 0 or not self._proximal_from_forward) for i, p in enumerate(parts)]
        critic_metrics: dict[str, float] = {}
        if self.critic is not None:  # GAE over every policy token, before stale tokens leave the loss
            parts, critic_metrics = self.critic.prepare(parts)
        parts, age = mask_stale_tokens(parts, self.version, self.trainer.eta, self.trainer.staleness_level == "token")
        age = age.to(self.device)
        # num_seqs: rows with a loss token (padding rows, tool-only or all-stale responses add nothing to a sequence mean)
        counts = torch.tensor([[p.num_tokens, float((p.loss_mask.sum(dim=-1) > 0).sum())] for p in parts],
                              dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(counts)  # each mini-batch's global normalisers
            dist.all_reduce(age)
        out, mismatch = [], MismatchStats(self.device)
        for i, (part, (num_tokens, num_seqs)) in enumerate(zip(parts, counts.tolist())):
            m = self.forward_backward(part, num_tokens=num_tokens, num_seqs=num_seqs, first=i == 0, mismatch=mismatch)
            last = i == len(parts) - 1
            if self.critic is not None:
                m.update(self.critic.update(part, num_tokens=num_tokens, num_seqs=num_seqs, end_of_step=last))
            m.update(self.optimizer_step(end_of_step=last))
            out.append(m)
        metrics = merge_minibatch_metrics(out) if len(out) > 1 else out[0]
        skipped = sum(m["skipped"] for m in out)
        metrics.pop("skipped")
        metrics["skipped_minibatches"], metrics["bad_step"] = skipped, float(skipped > 0)
        self._count_bad_step(skipped > 0, metrics["grad_norm"])
        metrics["entropy_coef"] = self.adapt_entropy_coef(metrics.get("entropy", math.nan)) if not skipped else self.entropy_coef
        metrics.update(token_age_metrics(age))
        metrics.update(mismatch.metrics(self.world))  # exact over the whole step (`mismatch.py`)
        metrics.update(critic_metrics)
        return metrics


    def _count_bad_step(self, bad: bool, grad_norm: float) -> None:
        """Consecutive bad steps (a mini-batch with a non-finite gradient norm was skipped):
        `trainer.max_bad_steps` in a row stop the run. Every rank sees the same global norm,
        so every rank counts the same.

        Trace (max_bad_steps 3): step 7 nan -> 1, step 8 ok -> 0, steps 9, 10 nan -> 2, step 11 nan -> raise.
        """
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if bad else 0
        self.bad_steps += int(bad)
        if self.bad_steps_in_a_row >= self.trainer.max_bad_steps:
            raise FloatingPointError(
                f"trainer step {self.step - 1}: {self.bad_steps_in_a_row} steps in a row had a non-finite gradient norm "
                f"(last {grad_norm}; non-finite loss or logits): stopping (trainer.max_bad_steps={self.trainer.max_bad_steps})")

    @property
    def _proximal_from_forward(self) -> bool:
        """The first mini-batch's proximal log-probs come from its own training forward (`trainer.proximal_forward=auto`)."""
        return self.corrector.needs_proximal and self.trainer.proximal_forward == "auto"

    def _with_fixed_logprobs(self, rows: TrainBatch, proximal: bool = True) -> TrainBatch:
        """Fill in the reference and (with `proximal`) the proximal log-probs of this rank's rows, with the current weights."""
        if self.ref_model is not None and rows.ref_logprobs is None:
            rows = rows.replace(ref_logprobs=self.scorer.score_local(self.ref_model, rows).float().cpu())
        if proximal and self.corrector.needs_proximal and rows.proximal_logprobs is None:
            rows = rows.replace(proximal_logprobs=self.scorer.score_local(self.model, rows).float().cpu())
        return rows

    def adapt_entropy_coef(self, entropy: float) -> float:
        """Adaptive entropy control: move the bonus weight toward keeping `entropy` at the target.

        Returns the weight used in the step just taken. With `entropy_target` = 0 nothing changes.
        Every rank sees the same all-reduced entropy, so every rank keeps the same weight.
        Trace (target 0.5, lr 0.01): entropy 0.1 -> weight +0.004; entropy 0.9 -> -0.004, never below 0.
        """
        used, alg = self.entropy_coef, self.algorithm
        if alg.entropy_target > 0 and math.isfinite(entropy):
            self.entropy_coef = min(max(used + alg.entropy_coef_lr * (alg.entropy_target - entropy), 0.0), alg.entropy_coef_max)
        return used

    def forward_backward(self, rows: TrainBatch, *, num_tokens: float, num_seqs: float, first: bool = True,
                         mismatch: MismatchStats | None = None) -> dict[str, float]:
        """Accumulate gradients of the globally normalised loss over this rank's `rows` (one
        mini-batch), micro-batch by micro-batch; `num_tokens` / `num_seqs` are the mini-batch's
        loss tokens and sequences over every rank; `first`: no optimizer step was taken yet in
        this trainer step (the weights are still those of version `step`).

        Metrics: `loss`, `pg_loss` (aggregated as `algorithm.loss_agg`, or per sequence for a sequence-level
        loss: `PolicyLoss.agg`), token means over the
        batch's loss tokens of `kl`, `entropy`, `clip_frac`, `clip_frac_lower` (dual clip bound: verl's
        `pg_clipfrac_lower`), `ratio_mean`, and `ratio_max`,
        `ratio_min`, `tokens` (loss tokens), `seqs`; plus the off-policy `correction/*`
        statistics (`corrections.stat_metrics`), and verl's `rollout_probs_diff_{mean,max}`:
        |p_rollout - p_trainer| of the loss tokens the rollout sampled with the weights the trainer
        holds now (`token_versions == version`: no staleness, so any gap is the two engines disagreeing,
        e.g. weights that did not arrive whole), scored with the proximal log-probs or, without
        them, the first mini-batch's forward; `rollout_probs_diff_tokens` counts those tokens. `mismatch`
        gathers the step's `mismatch/*` sums; the caller reduces them once the step's mini-batches are done.
        """
        alg = self.algorithm
        # the step's first mini-batch runs on the step's starting weights: its training forward is its proximal policy
        reuse = first and self._proximal_from_forward
        rows = self._with_fixed_logprobs(rows, proximal=not reuse)
        norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_len=alg.loss_agg_norm_len)
        want_entropy = self.entropy_coef > 0 or alg.entropy_target > 0  # else neither the loss nor the control reads it
        acc = MiniBatchSums.zeros(self.trainer.eta, self.device)
        mbs = self.scorer.micro_batches(rows)
        once = self.trainer.grad_reduce == "mini_batch" and len(mbs) > 1
        for j, (mb, packed) in enumerate(mbs):
            if once:  # FSDP reduce-scatters at the last micro-batch only; before it gradients accumulate unsharded
                self.model.set_requires_gradient_sync(j == len(mbs) - 1)
            self._micro_step(mb, packed, acc, norm=norm, first=first, reuse=reuse, entropy=want_entropy, mismatch=mismatch)
        if once:
            self.model.set_requires_gradient_sync(True)
        return acc.metrics(self.world, num_tokens, num_seqs, want_entropy)

    def _micro_step(self, mb: TrainBatch, packed: Packed | None, acc: MiniBatchSums, *, norm: dict[str, float], first: bool,
                    reuse: bool, entropy: bool, mismatch: MismatchStats | None) -> None:
        """One micro-batch of `forward_backward` (on the device): forward, loss, backward, its sums into `acc`. No
        host sync of its own (tests/unit/trainer/test_speed_switches.py counts them)."""
        alg, mask = self.algorithm, mb.loss_mask
        logprobs, ent = self.scorer.logprobs_and_entropy(self.model, mb, entropy=entropy, entropy_grad=self.entropy_coef > 0, packed=packed)
        ent = torch.zeros_like(logprobs) if ent is None else ent
        if reuse:  # the step's starting weights: the proximal policy's log-probs are these, detached
            mb = mb.replace(proximal_logprobs=logprobs.detach())
        corr = self.corrector(
            logprobs, mb.old_logprobs, mask,
            proximal_logprobs=mb.proximal_logprobs, token_versions=mb.token_versions, version=self.version,
        )
        inputs = LossInputs.of(logprobs, mb.old_logprobs, mb.advantages, mask, proximal_logprobs=corr.proximal_logprobs,
                               clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high)
        out = self.policy_loss(inputs, self.loss_settings)
        pg_loss = agg_loss(out.loss * corr.weight, mask, self.policy_loss.agg(alg.loss_agg), **norm)
        loss = pg_loss
        if self.entropy_coef > 0:
            # with a target, a token's entropy counts only up to it: the bonus lifts collapsed tokens and
            # never pushes one further (an unbounded bonus can drive the policy to uniform and rewards to 0)
            bonus = ent.clamp(max=alg.entropy_target) if alg.entropy_target > 0 else ent
            loss = loss - self.entropy_coef * agg_loss(bonus, mask, alg.loss_agg, **norm)
        kl = torch.zeros_like(logprobs)
        if mb.ref_logprobs is not None:
            kl = kl_penalty(logprobs, mb.ref_logprobs, alg.kl_estimator)
            if alg.kl_coef > 0:
                loss = loss + alg.kl_coef * agg_loss(kl, mask, alg.loss_agg, **norm)
        # FSDP averages gradients over ranks; the loss is already globally normalised, so undo the mean
        # (a divide factor of 1 would need PREMUL_SUM, which gloo lacks)
        (loss * self.world).backward()
        with torch.no_grad():
            dual = out.dual_clipped if out.dual_clipped is not None else torch.zeros_like(out.ratio)
            if mismatch is not None:
                mismatch.add(corr, mask)
            acc.add(loss=loss, pg_loss=pg_loss, per_token=torch.stack([kl, ent, out.clipped, out.ratio, dual]), ratio=out.ratio,
                    corr=corr, mask=mask, eta=self.trainer.eta, diff=rollout_probs_diff(mb, logprobs, first, self.version),
                    ages=None if mb.token_versions is None else self.version - mb.token_versions)

    def optimizer_step(self, end_of_step: bool = True) -> dict[str, float]:
        """Clip, AdamW step; at the end of a trainer step also advance the schedule and `step` += 1.
        Returns `grad_norm` (before clipping) and `lr` used."""
        lr = self.scheduler.get_last_lr()[0]
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, self.trainer.grad_clip)
        skipped = not stepped
        if skipped:  # no update from this mini-batch: the weights and the optimizer state stay as they were
            log.warning("trainer step %d: gradient norm is %s (non-finite loss or logits): mini-batch skipped", self.step, grad_norm)
        if end_of_step:  # a skipped step still counts: the batch was consumed and the version advances
            self.scheduler.step()
            self.step += 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    # ---- weights ----------------------------------------------------------
    def iter_full_params(self, device: str | torch.device = "cpu", borrowed: bool = False) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor in the model dtype on `device`), one FSDP unit at a time; every rank
        must iterate to the end (all-gathers). See `weights.full_params`."""
        from asyncrl.trainer.weights import full_params

        return full_params(self.model, self.dtype, device, borrowed=borrowed)

    def reshard(self) -> None:
        """Every FSDP unit of the policy back to its shards (local, no collective). FSDP2 keeps the root
        unit gathered after a forward without backward (the parity probe's), and `state_dict()` reshards
        it: ranks that read their shards for a receiver and ranks that had none to send to would then
        start the next forward with different all-gathers (gloo aborts on the size mismatch). Called at
        the end of every publish and sync, on every rank, so they leave it alike."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def iter_local_shards(self, device: str | torch.device = "cpu") -> Iterator[tuple[str, Tensor, list[int], int]]:
        """This rank's rows of every parameter, no collective. See `weights.local_shards`."""
        from asyncrl.trainer.weights import local_shards

        return local_shards(self.model, self.rank, self.world, self.dtype, device)

    def save(self, path: str) -> None:
        from asyncrl.trainer.checkpoint import save

        save(self, path)

    def load(self, path: str) -> None:
        from asyncrl.trainer.checkpoint import load

        load(self, path)

    def close(self) -> None:
        """Release the models; tear down the process group only if this engine started it."""
        self.model = self.ref_model = self.critic = None  # type: ignore[assignment]
        self.optimizer = self.scheduler = None  # type: ignore[assignment]
        if self._owns_process_group and dist.is_initialized():
            close_process_group()  # FSDP's cycles freed with the group alive, then a barrier, then the teardown
            self._owns_process_group = False

