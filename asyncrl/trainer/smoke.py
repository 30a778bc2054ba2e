"""A synthetic batch and a `main()` that runs train steps on it, under torchrun or alone.

Used to check that N FSDP2 ranks take the same step as one rank (the integration test
runs this with `torchrun --nproc_per_node 2`) and as a quick smoke test of a model folder:

    torchrun --nproc_per_node 2 -m asyncrl.trainer.engine --model /path/to/model --out /tmp/r2.pt

Rank 0 writes `--out` (torch.save): per step the metrics, the full gradients of the
first step before clipping and the optimizer update, and the final full parameters;
`--save` writes a DCP checkpoint after the last step.
"""

from __future__ import annotations

import argparse
import random

import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.batch import TrainBatch
from asyncrl.types import Trajectory


def synthetic_batch(num_seqs: int, *, vocab_size: int, seed: int = 0, pad_id: int = 0, groups_of: int = 4) -> TrainBatch:
    """Random prompts/responses of varied lengths, a tool span in some responses, random behavior log-probs and rewards."""
    from asyncrl.trainer.advantages import compute_advantages

    rng = random.Random(seed)
    trajs = []
    for i in range(num_seqs):
        p, r = rng.randint(2, 6), rng.randint(1, 8)
        mask = [1] * r
        if r > 3 and rng.random() < 0.5:  # a tool/env span the policy did not write
            mask[1:3] = [0, 0]
        trajs.append(
            Trajectory(
                uid=f"s{i}", group_id=f"g{i // groups_of}", index_in_group=i % groups_of, group_size=groups_of,
                prompt_ids=[rng.randrange(1, vocab_size) for _ in range(p)],
                response_ids=[rng.randrange(1, vocab_size) for _ in range(r)],
                behavior_logprobs=[-rng.uniform(3.5, 5.5) * m for m in mask],
                loss_mask=mask, token_versions=[0 if m else -1 for m in mask], min_version=0, max_version=0,
                reward=float(rng.random() < 0.5),
            )
        )  # fmt: skip
    adv = compute_advantages("grpo", [t.reward for t in trajs], [t.group_id for t in trajs])
    return TrainBatch.from_trajectories(trajs, adv, pad_id=pad_id)


def full_grads(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001 - TrainerEngine, imported lazily
    """Unsharded gradients by parameter name (collective)."""
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out


def main(argv: list[str] | None = None) -> None:
    from asyncrl.trainer.engine import TrainerEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local HF model folder")
    ap.add_argument("--out", default="", help="rank 0 writes metrics and first-step gradients here")
    ap.add_argument("--num-seqs", type=int, default=7)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--loss-agg", default="token_mean")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="", help="write a DCP checkpoint here after the last step")
    args = ap.parse_args(argv)

    trainer = TrainerConfig(micro_batch_size=args.micro_batch_size, lr=args.lr, total_steps=max(args.steps, 1), threads=1)
    algorithm = AlgorithmConfig(loss_agg=args.loss_agg, kl_coef=args.kl_coef)
    engine = TrainerEngine(args.model, trainer=trainer, algorithm=algorithm, seed=args.seed)
    vocab = engine.model.config.vocab_size
    batch = synthetic_batch(args.num_seqs, vocab_size=vocab, seed=args.seed)
    batch = batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask - 0.05 * batch.loss_mask)
    result: dict[str, object] = {"metrics": [], "world": engine.world}
    for step in range(args.steps):
        rows = batch.shard(engine.rank, engine.world)  # this rank's rows, global normalisers
        metrics = engine.forward_backward(rows, num_tokens=batch.num_tokens, num_seqs=float(len(batch)))
        if step == 0:
            result["grads"] = full_grads(engine)
        metrics.update(engine.optimizer_step())
        result["metrics"].append(metrics)  # type: ignore[union-attr]
        if engine.rank == 0:
            print(f"step {engine.step}: " + " ".join(f"{k}={v:.6g}" for k, v in metrics.items()), flush=True)
    result["params"] = dict(engine.iter_full_params())
    if args.save:
        engine.save(args.save)
    if engine.rank == 0 and args.out:
        torch.save(result, args.out)
    engine.close()


if __name__ == "__main__":
    main()
