"""The Ray shell: two TrainerRankActor ranks behind TrainerGroup. Each rank reads only its own rows of a
batch straight from the shm plane this process wrote them into, the step is taken, and rank 0
publishes the weights straight to a receiver here (Ray start costs ~7 s)."""

import random
import threading

import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


def _trajectories(n, vocab, seed=3):
    from asyncrl.types import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(2, 6), rng.randint(1, 8)
        out.append(Trajectory(uid=f"s{i}", group_id=f"g{i // 4}", index_in_group=i % 4, group_size=4,
                              prompt_ids=[rng.randrange(1, vocab) for _ in range(p)],
                              response_ids=[rng.randrange(1, vocab) for _ in range(r)],
                              behavior_logprobs=[-4.0] * r, loss_mask=[1] * r, token_versions=[0] * r,
                              min_version=0, max_version=0, reward=float(i % 2)))
    return out


def test_trainer_group_ranks_read_their_shards_and_publish_to_a_receiver(tiny_model_path, tmp_path):
    from asyncrl.batching import PlanBuilder
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.trainer.actor import TrainerGroup
    from asyncrl.trajectory_queue import trajectory_sample
    from checkpoint_engine import ShardedReceiver, WeightsConfig
    from transfer_queue import TransferQueueConfig, make_storage

    queue = TransferQueueConfig(storage="shm", shm_dir=str(tmp_path), inline_max_bytes=0, run_id="actor")
    plane = make_storage(queue)  # this process is the producer: the ranks map its arena
    trajs = _trajectories(8, vocab=100)
    groups = [[trajectory_sample(plane, t) for t in trajs[g * 4:(g + 1) * 4]] for g in range(2)]
    plan, tokens = PlanBuilder(AlgorithmConfig(), pad_id=0, minibatches=1)(groups)
    weights = WeightsConfig(backend="shm", timeout_s=5)  # also how long the publish waits for "absent" to join
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = TrainerGroup(2, tiny_model_path, trainer=TrainerConfig(micro_batch_size=2, threads=1, minibatches=1),
                             algorithm=AlgorithmConfig(), queue=queue, weights=weights)
        assert len(group.endpoints) == 2 and all(e.startswith("tcp://127.0.0.1:") for e in group.endpoints)  # shm: every rank sends its rows
        metrics = group.train(plan)
        assert group.step == 1 and metrics["tokens"] == tokens == sum(len(t.response_ids) for t in trajs)
        assert metrics["seqs"] == 8 and metrics["grad_norm"] > 0
        # rank 0 read its own 4 rows only (spread by tokens: `BatchPlan.shard`), nothing of the other four
        own = [r for r in plan.shard(0, 2)[0] if r is not None]
        assert len(own) == 4
        mine = sum(h["nbytes"] for r in own for h in r.handles.values())
        assert metrics["read_bytes"] == mine

        got = {}
        rx = ShardedReceiver(weights, "r0", endpoints=group.endpoints)  # each rank's rows, assembled here

        def receive():
            update = rx.next_update(timeout_s=60)
            got.update({n: t.clone() for n, t in update})

        th = threading.Thread(target=receive)
        th.start()
        out = group.publish(1, ["r0", "absent"])
        th.join(60)
        assert out["completed"] == ["r0"] and out["evicted"] == {"absent": "not joined"} and rx.version == 1
        assert out["gather_s"] < 1.0  # no all-gather: the ranks sent their own rows
        assert got["lm_head.weight"].shape == (100, 128) and len(got) == 27
        from safetensors.torch import load_file

        before = load_file(f"{tiny_model_path}/model.safetensors")
        assert not torch.equal(got["lm_head.weight"], before["lm_head.weight"])  # the trained weights, not the file's
        assert max((got[n] - before[n]).abs().max().item() for n in before) < 0.1  # one small step away
        rx.close()
        group.close()
    finally:
        ray.shutdown()
        plane.close()
