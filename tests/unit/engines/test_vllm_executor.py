"""The vLLM executor a server asks for: `mp` whenever a server has several tensor-parallel workers
(inside a Ray actor vLLM would otherwise pick its Ray executor from the actor's placement group,
whose one bundle already belongs to the actor), `uni` in process, vLLM's own choice for one worker."""

from __future__ import annotations

from asyncrl.engines.vllm_engine import executor_backend


def test_tensor_parallel_servers_use_the_multiprocessing_executor():
    assert executor_backend(in_process=False, tensor_parallel_size=2) == "mp"
    assert executor_backend(in_process=False, tensor_parallel_size=8) == "mp"


def test_one_worker_keeps_the_former_choices():
    assert executor_backend(in_process=True, tensor_parallel_size=1) == "uni"
    assert executor_backend(in_process=False, tensor_parallel_size=1) is None  # vLLM's `uni` for one worker

