"""The trainer pool: FSDP2 ranks that turn batches of trajectories into optimizer steps.

- `batch.py`: `TrainBatch`, the padded [B, T] tensors of one step (built from `Trajectory` records);
- `advantages.py`, `losses.py`: pure tensor functions in registries, picked by `algorithm.*` names;
- `engine.py`: `TrainerEngine`, one FSDP2 rank (`compute_logprobs`, `train_step`, `iter_full_params`);
- `checkpoint.py`: DCP save / load of model, optimizer, schedule and step;
- `actor.py`: the Ray shell (`TrainerWorker`, `TrainerGroup`), the only module here that imports ray;
- `smoke.py`: a synthetic batch and the `torchrun -m asyncrl.trainer.engine` entry point.

Nothing is imported here, so `import asyncrl.trainer.advantages` stays free of transformers and ray.
"""
