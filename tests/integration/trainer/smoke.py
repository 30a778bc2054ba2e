"""A torchrun harness: train steps on a synthetic batch, under torchrun or alone.

Used to check that N FSDP2 ranks take the same step as one rank (test_fsdp_equivalence.py
runs this file with `torchrun --nproc_per_node 2`) and as a quick smoke test of a model folder:

    torchrun --nproc_per_node 2 tests/integration/trainer/smoke.py --model /path/to/model --out /tmp/r2.pt

Rank 0 writes `--out` (torch.save): per step the metrics, the full gradients of the
first step before clipping and the optimizer update, and the final full parameters;
`--save` writes a DCP checkpoint after the last step.
Boundary: outside the package on purpose (a harness, not a component); the batch comes from
`asyncrl.trainer.synthetic`.
"""

from __future__ import annotations

import argparse

import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.synthetic import full_grads, synthetic_batch


def own_rows(batch, engine, contiguous: bool):  # noqa: ANN001, ANN201
    """This rank's rows: `TrainBatch.shard` (spread by tokens), or with `contiguous` the rank's slice of
    ceil(B / world) rows in batch order (any split gives the same step: the normalisers are global)."""
    if not contiguous:
        return batch.shard(engine.rank, engine.world)
    per = -(-len(batch) // engine.world)
    assert len(batch) == per * engine.world, "--by-length: a batch that splits evenly"
    return batch[engine.rank * per:(engine.rank + 1) * per]


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
    ap.add_argument("--advantage", default="grpo", help="gae: whole `train_step`s with the critic (GAE on each rank's rows)")
    ap.add_argument("--max-tokens", type=int, default=0, help="trainer.max_tokens_per_micro_batch (token-budget micro-batches)")
    ap.add_argument("--by-length", action="store_true",
                    help="rows sorted by length, each rank a contiguous slice (not spread by tokens): rank 0's rows "
                         "short, the last rank's long, so their token-budget micro-batch counts differ")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another trainer.* setting (the speed switches: grad_reduce=mini_batch, optimizer_impl=fused, ...)")
    args = ap.parse_args(argv)
    extra = {k: {"true": True, "false": False}.get(v, v) for k, v in (item.split("=", 1) for item in args.set)}

    trainer = TrainerConfig(micro_batch_size=args.micro_batch_size, lr=args.lr, total_steps=max(args.steps, 1), threads=1,
                            max_tokens_per_micro_batch=args.max_tokens, **extra)
    algorithm = AlgorithmConfig(loss_agg=args.loss_agg, kl_coef=args.kl_coef, advantage=args.advantage,
                                **({"lam": 0.95, "use_kl_in_reward": True} if args.advantage == "gae" else {}))
    engine = TrainerEngine(args.model, trainer=trainer, algorithm=algorithm, seed=args.seed)
    vocab = engine.model.config.vocab_size
    batch = synthetic_batch(args.num_seqs, vocab_size=vocab, seed=args.seed)
    if args.by_length:
        batch = batch[torch.argsort(batch.attention_mask.sum(dim=1), stable=True)]
    if args.max_tokens:  # how many micro-batches this rank's shard needs alone, and how many it runs in step
        rows = own_rows(batch, engine, args.by_length)
        alone = len(rows.micro_batch_rows(args.micro_batch_size, args.max_tokens))
        print(f"rank {engine.rank}: {alone} micro-batches alone, {len(engine.scorer.micro_batch_rows(rows))} in step", flush=True)
    batch = batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask - 0.05 * batch.loss_mask)
    result: dict[str, object] = {"metrics": [], "world": engine.world}
    if engine.critic is not None:  # the full step: minibatches, GAE whitened over the ranks, critic updates
        from asyncrl.trainer.gae import token_rewards
        from asyncrl.trainer.weights import full_params

        scores = torch.linspace(0.0, 1.0, len(batch))
        batch = batch.replace(token_rewards=token_rewards(scores, batch.loss_mask))
        for _ in range(args.steps):
            result["metrics"].append(engine.train_step(batch))  # type: ignore[union-attr]
        result["params"] = dict(engine.iter_full_params())
        result["critic_params"] = dict(full_params(engine.critic.model, engine.dtype, "cpu"))
        args.steps = 0
    for step in range(args.steps):
        rows = own_rows(batch, engine, args.by_length)  # this rank's rows, global normalisers
        metrics = engine.forward_backward(rows, num_tokens=batch.num_tokens, num_seqs=float(len(batch)))
        if step == 0:
            result["grads"] = full_grads(engine)
        metrics.update(engine.optimizer_step())
        result["metrics"].append(metrics)  # type: ignore[union-attr]
        if engine.rank == 0:
            print(f"step {engine.step}: " + " ".join(f"{k}={v:.6g}" for k, v in metrics.items()), flush=True)
    if "params" not in result:
        result["params"] = dict(engine.iter_full_params())
    if args.save:
        engine.save(args.save)
    if engine.rank == 0 and args.out:
        torch.save(result, args.out)
    engine.close()


if __name__ == "__main__":
    main()
