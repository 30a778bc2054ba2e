"""Scoring one rank's rows under a model: micro-batches in step across the ranks, packed rows, chunked log-probs.

`Scorer` is the forward half of a trainer step, with no optimizer and no loss: `TrainerEngine` runs its
training forward through `logprobs_and_entropy` and its reference / proximal passes through `score_local` /
`score`; `asyncrl bench trainer --shape` runs it on a bare model. Micro-batches are planned as many on every
rank (`batch.micro_batch_plan`), so FSDP's collectives meet.

    scorer = Scorer(trainer_cfg, temperature=1.0, device=torch.device("cpu"), rank=0, world=1)
    lp, ent = scorer.logprobs_and_entropy(model, mb)      # [b, T] each, column 0 unscored
    full = scorer.score(model, batch)                     # [B, T] on the host, every rank's rows gathered
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config import TrainerConfig
from asyncrl.trainer.batch import TrainBatch, micro_batch_plan, micro_batches_in_step, stand_in
from asyncrl.trainer.losses import entropy_from_logits, token_logprobs
from asyncrl.trainer.packing import Packed, head_scores, pack


@dataclass
class Scorer:
    """The settings a forward reads (`trainer.micro_batch_size`, `max_tokens_per_micro_batch`, `packing`,
    `logit_chunk_tokens`), the sampling `temperature`, and this rank's place."""

    trainer: TrainerConfig
    temperature: float
    device: torch.device
    rank: int = 0
    world: int = 1

    def micro_batches(self, rows: TrainBatch) -> list[tuple[TrainBatch, Packed | None]]:
        """`trainer.micro_batch_size` rows each, or token-budget groups (`trainer.max_tokens_per_micro_batch`), as
        many on every rank (`batch.micro_batch_plan`; a stand-in row with no loss token where this rank has none),
        with their packing (`trainer.packing`). Cut, trimmed and packed where `rows` are (the host, in a step),
        then moved to the device, all before the loop over them: the loop never waits for a shape from the device."""
        mbs = micro_batches_in_step(rows, self.trainer.micro_batch_size, self.trainer.max_tokens_per_micro_batch, self.world, self.device)
        packs = [pack(mb.input_ids, mb.attention_mask).to(self.device) if self.trainer.packing else None for mb in mbs]
        return [(mb.to(self.device), p) for mb, p in zip(mbs, packs)]

    def micro_batch_rows(self, rows: TrainBatch) -> list[Tensor | None]:
        """Row indices of each micro-batch, as many on every rank (collective with a token budget); None: a stand-in pass."""
        return micro_batch_plan(rows, self.trainer.micro_batch_size, self.trainer.max_tokens_per_micro_batch, self.world, self.device)

    def logprobs_and_entropy(self, model: torch.nn.Module, mb: TrainBatch, *, entropy: bool = True,
                              entropy_grad: bool = False, packed: Packed | None = None) -> tuple[Tensor, Tensor | None]:
        """[b, T] log-probs and entropies (None without `entropy`: not computed) at `temperature` of one
        micro-batch, aligned like `TrainBatch` (column 0 unscored); the entropy carries a gradient only with
        `entropy_grad`.

        `trainer.packing`: the rows run as one packed row (`packed`, or packed here) and the scores are
        unpacked (0 at padding); `trainer.logit_chunk_tokens`: the LM head runs chunk by chunk (`packing.head_scores`)."""
        ids, inputs = mb.input_ids, {"attention_mask": mb.attention_mask}
        if packed is None and self.trainer.packing:
            packed = pack(mb.input_ids, mb.attention_mask)
        if packed is not None:  # no attention mask: the restarting position ids delimit the sequences
            ids, inputs = packed.input_ids, {"position_ids": packed.position_ids}
        if self.trainer.logit_chunk_tokens:
            with head_scores(model, ids, temperature=self.temperature, chunk=self.trainer.logit_chunk_tokens, entropy_grad=entropy_grad,
                             entropy=entropy):
                scores = model(input_ids=ids, use_cache=False, **inputs).logits
            logprobs, ent = scores[..., 0], scores[..., 1] if entropy else None
        else:
            logits = model(input_ids=ids, use_cache=False, **inputs).logits
            logprobs, ent = token_logprobs(logits, ids, self.temperature), None
            if entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    ent = torch.nn.functional.pad(entropy_from_logits(logits[:, :-1] / self.temperature), (1, 0))
        if packed is not None:
            logprobs, ent = packed.unpack(logprobs), None if ent is None else packed.unpack(ent)
        return logprobs, ent

    @torch.no_grad()
    def score_local(self, model: torch.nn.Module, rows: TrainBatch) -> Tensor:
        """[b, T] log-probs of this rank's `rows` under `model` (on the device; 0 at t=0 and padding)."""
        rows = rows.to(self.device)
        out = torch.zeros(rows.input_ids.shape, dtype=torch.float32, device=self.device)
        for idx in self.micro_batch_rows(rows):  # token-budget groups are not in row order
            if idx is None:  # a pass the other ranks run too (their collectives need this rank's)
                self.logprobs_and_entropy(model, stand_in(rows), entropy=False)
                continue
            lp, _ = self.logprobs_and_entropy(model, rows[idx.to(self.device)].trim(), entropy=False)
            out[idx.to(self.device), : lp.shape[1]] = lp.float()
        out = out * rows.attention_mask
        out[:, 0] = 0.0
        return out

    @torch.no_grad()
    def score(self, model: torch.nn.Module, batch: TrainBatch) -> Tensor:
        """[B, T] log-probs of the full batch under `model`: each rank scores its shard, then all-gather."""
        shard = batch.shard(self.rank, self.world)
        local = self.score_local(model, shard)
        if self.world == 1:
            out = local[: len(batch)].float().cpu()
        else:
            gathered = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(gathered, local)
            out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
            for rows, scores in zip(batch.shard_rows(self.world), gathered):  # each rank's rows back in batch order
                out[rows] = scores[: len(rows)].float().cpu()
        out[:, 0] = 0.0
        return out
