"""The trainer: FSDP2 ranks that turn batches of trajectories into optimizer steps.

Its parts are named by the process they live in:
- engine (`engine.py`: `TrainerEngine`, or `cost_model.py`): one FSDP2 rank's math (`compute_logprobs`,
  `train_step`, `iter_full_params`), in the rank's process; knows no planes and no Ray;
- rank (`rank.py`: `TrainerRank`, `build_engine`, `TrainerDied`): what runs in one process, the engine plus
  its data plane and weight sender; the embedded default runs one in the controller's process;
- rank actor (`actor.py`: `TrainerRankActor`, titled `ray::TrainerRankActor`): a rank in its own Ray process;
- group (`actor.py`: `TrainerGroup`): the controller's handle to N rank actors, with a rank's blocking verbs.
The controller runs the rank's or the group's verbs off its event loop, one at a time (`calls.py`: `AsyncTrainer`).

- `batch.py`: `TrainBatch`, the padded [B, T] tensors of one step (built from `Trajectory` records);
- `plan.py`: `BatchPlan`, the handles of one step's rows, and how a rank reads its shard;
- `advantages.py`, `losses.py`, `corrections.py`: pure tensor functions in registries, picked by `algorithm.*` names;
- `gae.py`, `critic.py`: GAE and PPO's value model (`algorithm.advantage=gae`);
- `scoring.py`, `packing.py`: the forward half of a step (`Scorer`), packed sequences and chunked log-probs;
- `lora.py`: LoRA adapters merged on the way out;
- `checkpoint.py`: DCP save / load of model, optimizer, schedule and step (and the critic's);
- `weights.py`: the parameters read out of an FSDP2 model for a publish;
- `synthetic.py`: a synthetic batch for tests and the FSDP2 equivalence harness (tests/integration/trainer/smoke.py).
`actor.py` is the only module here that imports ray.

Nothing is imported here, so `import asyncrl.trainer.advantages` stays free of transformers and ray.
"""
