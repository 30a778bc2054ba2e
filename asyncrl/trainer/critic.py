"""Critic: the value model of PPO (`algorithm.advantage=gae`), on the same FSDP2 ranks as the policy.

A Hugging Face `AutoModelForTokenClassification` with one label (the backbone of `critic.model_path`,
by default the policy's own weights, and a freshly initialised linear value head), sharded like the
policy (`load.load_sharded_model`), with its own AdamW, LR schedule and gradient clip. Each rank
runs it over its own rows only; the one collective beyond FSDP's is the whitening statistics.

Which policy its values belong to: at trainer step t the critic's weights are those after step
t - 1, trained on the samples of every step so far, which the staleness bound keeps within
`trainer.eta` versions of the policy. Its values therefore estimate the return of the recent
behaviour policies (the mixture the queue delivers), not of the version being trained; the actor's
off-policy correction (`corrections.py`) reweights the tokens, the values are a baseline and are
not reweighted. `V_old` in the clipped value loss is the critic's own prediction at the start of
the step, as in PPO.

Per trainer step (`TrainerEngine.train_local`):

    parts = critic.prepare(parts)        # values (no grad), GAE, advantages whitened over all ranks
    ... actor update on part i ...
    metrics = critic.update(part_i, num_tokens=..., num_seqs=...)   # one critic optimizer step

With `algorithm.use_kl_in_reward` the reward of each policy token is reduced by beta * KL(behaviour ||
reference) (`advantages.kl_in_reward`), beta from a fixed or adaptive `KLController`
(`algorithm.kl_ctrl.*`), updated once per step; beta is checkpointed with the critic.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from asyncrl.trainer.advantages import KLController, kl_in_reward
from asyncrl.trainer.batch import TrainBatch, micro_batch_plan, micro_batches_in_step, stand_in
from asyncrl.trainer.gae import gae_advantages, value_loss, whiten, whiten_sums
from asyncrl.trainer.losses import agg_loss, kl_penalty
from asyncrl.trainer.packing import pack
from asyncrl.trainer.load import load_sharded_model
from asyncrl.trainer.setup import adamw_with_schedule, clip_and_step


class CriticEngine:
    """The value model of one trainer rank: `values`, `prepare` (GAE), `update`, checkpoint state."""

    def __init__(self, model_path: str, *, engine: Any) -> None:
        e = engine
        self.trainer, self.algorithm, self.cfg = e.trainer, e.algorithm, e.critic_cfg
        self.device, self.rank, self.world = e.device, e.rank, e.world
        # from a causal LM's folder: its `lm_head` is left unread and the value head `score` is drawn new (`load.py`)
        self.model = load_sharded_model(self.cfg.model_path or model_path, self.device, e.dtype, trainable=True,
                                        gradient_checkpointing=self.trainer.gradient_checkpointing,
                                        auto_class="AutoModelForTokenClassification", attn_implementation=e.attn_implementation,
                                        compile=self.trainer.compile)
        self.optimizer, self.scheduler = adamw_with_schedule(self.model, self.trainer, self.cfg.lr or self.trainer.lr,
                                                             self.cfg.weight_decay)
        alg = self.algorithm
        k = alg.kl_ctrl
        self.kl_ctl = KLController(k.kl_coef, k.type, k.target_kl, k.horizon)

    # ---- values -------------------------------------------------------------
    def _forward(self, mb: TrainBatch) -> Tensor:
        """[b, T] values aligned like log-probs: column t holds V of the state before token t
        (the head's output at t - 1); column 0 is 0."""
        ids, inputs = mb.input_ids, {"attention_mask": mb.attention_mask}
        packed = pack(mb.input_ids, mb.attention_mask) if self.trainer.packing else None
        if packed is not None:
            ids, inputs = packed.input_ids, {"position_ids": packed.position_ids}
        with warnings.catch_warnings():
            # FSDP2 warns that the root module returned a view (the one-label head's [b, T, 1] output, which
            # nn.Linear returns as a view) and that an in-place op on it would skip the all-gather and give wrong
            # gradients; it is only read out of place here (`[..., 0].float()`), so the gradients are right
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
            out = self.model(input_ids=ids, use_cache=False, **inputs).logits[..., 0].float()
        if packed is not None:
            out = packed.unpack_positions(out)
        return torch.nn.functional.pad(out[:, :-1], (1, 0))

    @torch.no_grad()
    def values(self, rows: TrainBatch) -> Tensor:
        """[b, T] values of this rank's `rows` (on the device; 0 where the attention mask is 0)."""
        rows = rows.to(self.device)
        out = torch.zeros(rows.input_ids.shape, dtype=torch.float32, device=self.device)
        for idx in micro_batch_plan(rows, self.trainer.micro_batch_size, self.trainer.max_tokens_per_micro_batch, self.world, self.device):
            if idx is None:  # as many passes as the other ranks (`batch.micro_batch_plan`)
                self._forward(stand_in(rows))
                continue
            idx = idx.to(self.device)
            v = self._forward(rows[idx].trim())
            out[idx, : v.shape[1]] = v
        return out * rows.attention_mask

    # ---- advantages -----------------------------------------------------------
    def prepare(self, parts: list[TrainBatch]) -> tuple[list[TrainBatch], dict[str, float]]:
        """Every mini-batch part of this step with `values`, `returns` and whitened GAE `advantages`
        (from `token_rewards`, minus the KL penalty with `algorithm.kl_in_reward`). Collective:
        every rank calls it with its own parts."""
        alg = self.algorithm
        shaped, values, kl_sums = [], [], torch.zeros(2, dtype=torch.float64)
        for p in parts:
            if p.token_rewards is None:
                raise ValueError("algorithm.advantage=gae: the batch carries no rewards (TrainBatch.token_rewards)")
            r = p.token_rewards.float()
            if alg.use_kl_in_reward:
                if p.ref_logprobs is None:
                    raise RuntimeError("algorithm.use_kl_in_reward: no reference log-probs in the batch")
                kl = kl_penalty(p.old_logprobs, p.ref_logprobs, alg.kl_estimator)
                r, current = kl_in_reward(r, kl, p.loss_mask, self.kl_ctl.value)
                rows = float(((p.loss_mask.sum(dim=-1)) > 0).sum())
                kl_sums += torch.tensor([current * rows, rows], dtype=torch.float64)
            shaped.append(r)
            values.append(self.values(p).cpu())
        gae = [gae_advantages(r, v, p.loss_mask, gamma=alg.gamma, lam=alg.lam) for r, v, p in zip(shaped, values, parts)]
        stats = torch.stack([whiten_sums(a, p.loss_mask) for (a, _), p in zip(gae, parts)]).sum(dim=0)
        ret_sums = torch.stack([whiten_sums(ret, p.loss_mask) for (_, ret), p in zip(gae, parts)]).sum(dim=0)
        val_sums = torch.stack([whiten_sums(v, p.loss_mask) for v, p in zip(values, parts)]).sum(dim=0)
        sums = torch.cat([stats, ret_sums, val_sums, kl_sums]).to(self.device)
        if self.world > 1:
            dist.all_reduce(sums)
        sums = sums.cpu()
        out = [p.replace(advantages=whiten(a, p.loss_mask, sums[:3]), values=v, returns=ret)
               for (a, ret), v, p in zip(gae, values, parts)]
        n = max(float(sums[0]), 1.0)
        metrics = {"critic/advantages_mean": float(sums[1]) / n, "critic/returns_mean": float(sums[4]) / n,
                   "critic/values_mean": float(sums[7]) / n}
        if alg.use_kl_in_reward:
            kl_now = float(sums[9]) / max(float(sums[10]), 1.0)
            metrics["reward/kl"], metrics["reward/kl_coef"] = kl_now, self.kl_ctl.value
            self.kl_ctl.update(kl_now, int(sums[10]))
        return out, metrics

    # ---- training -------------------------------------------------------------
    def update(self, rows: TrainBatch, *, num_tokens: float, num_seqs: float, end_of_step: bool) -> dict[str, float]:
        """One critic optimizer step on this rank's rows of one mini-batch (global normalisers as
        for the policy loss); the schedule advances at the end of a trainer step."""
        alg = self.algorithm
        norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_len=alg.loss_agg_norm_len)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for mb in micro_batches_in_step(rows.to(self.device), self.trainer.micro_batch_size, self.trainer.max_tokens_per_micro_batch,
                                        self.world, self.device):
            vpreds = self._forward(mb)
            loss_tok, clipped = value_loss(vpreds, mb.values, mb.returns, self.cfg.cliprange_value)
            loss = agg_loss(loss_tok, mb.loss_mask, alg.loss_agg, **norm)
            (loss * self.world).backward()
            with torch.no_grad():
                m = mb.loss_mask
                sums += torch.stack([loss.double(), (clipped * m).sum().double(), (vpreds.detach() * m).sum().double()])
        if self.world > 1:
            dist.all_reduce(sums)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm, _ = clip_and_step(self.model, self.optimizer, self.cfg.grad_clip)  # non-finite: skipped, as for the policy
        if end_of_step:
            self.scheduler.step()
        s = sums.tolist()
        per_token = 1.0 / max(num_tokens, 1.0)
        return {"critic/vf_loss": s[0], "critic/vf_clipfrac": s[1] * per_token, "critic/vpred_mean": s[2] * per_token,
                "critic/grad_norm": grad_norm, "critic/lr": lr}


class CriticState(Stateful):
    """The critic's resumable state as DCP sees it: model, optimizer, schedule, KL-in-reward beta."""

    def __init__(self, critic: CriticEngine) -> None:
        self.critic = critic

    def state_dict(self) -> dict[str, Any]:
        c = self.critic
        model_sd, optim_sd = get_state_dict(c.model, c.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": c.scheduler.state_dict(), "kl_coef": c.kl_ctl.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        c = self.critic
        set_state_dict(c.model, c.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
        c.scheduler.load_state_dict(state_dict["scheduler"])
        c.kl_ctl.value = float(state_dict["kl_coef"])
