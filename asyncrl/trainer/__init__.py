"""The trainer pool: FSDP2 ranks that turn batches of trajectories into optimizer steps.

- `batch.py`: `TrainBatch`, the padded [B, T] tensors of one step (built from `Trajectory` records);
- `advantages.py`, `losses.py`, `corrections.py`: pure tensor functions in registries, picked by `algorithm.*` names;
- `gae.py`, `critic.py`: GAE and PPO's value model (`algorithm.advantage=gae`);
- `engine.py`: `TrainerEngine`, one FSDP2 rank (`compute_logprobs`, `train_step`, `iter_full_params`);
- `packing.py`, `lora.py`: packed sequences and chunked log-probs; LoRA adapters merged on the way out;
- `checkpoint.py`: DCP save / load of model, optimizer, schedule and step (and the critic's);
- `actor.py`: the Ray shell (`TrainerWorker`, `TrainerGroup`), the only module here that imports ray;
- `synthetic.py`: a synthetic batch for tests and the FSDP2 equivalence harness (tests/integration/trainer/smoke.py).

Nothing is imported here, so `import asyncrl.trainer.advantages` stays free of transformers and ray.
"""
