"""Helpers for the vLLM backend and weight-plane tests: run a coroutine on the module loop, HF
reference log-probs (from a model folder or from a state dict), deterministic new weights, the
bucket layout of a publish, and one publish scenario through the pipeline's path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Coroutine


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


class HFReference:
    """Teacher-forced fp32 HF forward: log-softmax(logits / T) at each response token."""

    def __init__(self, path: Path, model: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @classmethod
    def from_state(cls, path: Path, state: dict[str, Any]) -> "HFReference":
        """The folder's architecture (config.json) with exactly `state`'s tensors (all of them, in fp32)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).eval()
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise KeyError(f"state does not fit {path}: missing {missing}, unexpected {unexpected}")
        return cls(path, model)

    def logprobs(self, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
        import torch

        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.model.state_dict())


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


async def until(cond: Any, timeout: float = 30.0) -> None:
    """Poll `cond()` on the event loop until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)


def new_weights(template: dict[str, Any], seed: int) -> dict[str, Any]:
    """Fresh weights with `template`'s names, shapes and dtypes, the same for the same seed; every
    tensor differs from any other seed's (norm weights near 1, the rest N(0, 0.05^2)). Names are in
    sorted order, the order of a safetensors file (a publish's bucket layout follows it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(template):
        t = template[name]
        noise = torch.randn(t.shape, generator=g)
        out[name] = (1 + 0.1 * noise if "norm" in name else 0.05 * noise).to(t.dtype)
    return out


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused layers and the checkpoint tensors each is built from."""


def split_fused(state: dict[str, Any], bucket_bytes: int) -> dict[str, list[int]]:
    """The fused layers (`model.layers.0.self_attn.qkv_proj`, ...) whose checkpoint tensors land in
    more than one bucket when `state` is published with `bucket_bytes`: layer -> bucket indices.
    Laid out by the Sender's own packer, in `state`'s order."""
    import torch

    from checkpoint_engine.buckets import BucketPacker

    where: dict[str, set[int]] = {}
    packer, slot = BucketPacker(state.items(), bucket_bytes), torch.empty(bucket_bytes, dtype=torch.uint8)
    while (meta := packer.fill(slot, 0, False)) is not None:
        for e in meta.entries:
            prefix = e.name.rpartition(".")[0]  # model.layers.0.self_attn.q_proj(.weight)
            parent, _, part = prefix.rpartition(".")
            for fused, parts in FUSED.items():
                if part in parts:
                    where.setdefault(f"{parent}.{fused}", set()).add(meta.index)
    return {k: sorted(v) for k, v in where.items() if len(v) > 1}


async def publish_restart_scenario(make_server: Any, model: Path, cfg: Any, states: list[dict[str, Any]],
                                   prompt: list[int], max_tokens: int = 16) -> list[tuple[str, dict, Any, Any]]:
    """The pipeline's weight path, three times: a server joins the weight plane through
    `ServerHost.join_weights` (vLLM: its worker transport, the workers receive the buckets), a
    `Sender` publishes `states[0]` as v1 and `states[1]` as v2; then the server is closed and a
    fresh one (`make_server(model)`, the folder's weights) joins under the same name and is brought
    to v2 by `Sender.sync`. After each: generate from `prompt` (EOS off, so `max_tokens` tokens).
    Returns (label, the state served, the GenerateOutput, the UpdateOutcome) per step."""
    import asyncio

    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.host import ServerHost
    from checkpoint_engine import Sender

    async def start(endpoint: str) -> tuple[Any, ServerHost]:
        server = make_server(model)
        server.eos_token_ids = frozenset()
        host = ServerHost(server, name="srv-0", agent=None, eval_agent=None, plane=None)
        await host.join_weights(cfg, endpoint, pause_mode="keep")
        return server, host

    def generate(server: Any) -> Any:
        return server.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=0))

    current: dict[str, Any] = {}
    sender = Sender(cfg, state_fn=lambda: current["state"].items())
    steps: list[tuple[str, dict, Any, Any]] = []
    host = None
    try:
        server, host = await start(sender.endpoint)
        await asyncio.to_thread(sender.wait_for, 1, 60)
        for version, (label, state) in enumerate(zip(("first publish", "second publish"), states[:2]), start=1):
            current["state"] = state
            out = await asyncio.to_thread(sender.publish, state.items(), version)
            steps.append((label, state, await generate(server), out))
        await host.close()
        host = None
        server, host = await start(sender.endpoint)  # restarted: the folder's weights until synced
        await until(lambda: "srv-0" in sender.poll() and "srv-0" in sender.stats()["behind"], 60)
        out = await asyncio.to_thread(sender.sync)
        steps.append(("after restart + sync", current["state"], await generate(server), out))
    finally:
        if host is not None:
            await host.close()
        sender.close()
        # vLLM keeps the stack that built its first engine alive (frames pinned by an import made
        # there): drop the sender here so that a pinned frame does not hold it (a NIXL sender's
        # agent would keep a core busy for the rest of the process)
        del sender
    return steps
