"""The backend registry and the hooks `RolloutServer` declares: every name in `engines/registry.py` is a
`RolloutServer` that builds itself from the config; a weight-plane update reaches an engine through one
dispatch (`server_loop.apply_update` -> the engine's `load_update`, its own or the default)."""

from __future__ import annotations

import asyncio
import importlib

import pytest

from asyncrl.config import RolloutConfig
from asyncrl.engines.backends import build_server
from asyncrl.engines.base import GenerateOutput, RolloutServer, ServerStats
from asyncrl.engines.registry import BACKENDS
from checkpoint_engine.server_loop import apply_update


def test_every_registered_backend_is_a_rollout_server_built_from_config():
    assert set(BACKENDS) == {"torch", "vllm", "openai", "cost_model"}
    for name in BACKENDS:
        module, _, attr = BACKENDS[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)  # vllm, httpx and the model load lazily
        assert issubclass(cls, RolloutServer), name
        assert cls.from_config.__func__ is not RolloutServer.from_config.__func__, name


def test_build_server_builds_the_named_backend_and_refuses_an_unknown_one():
    from asyncrl.engines.cost_model import CostModelServer

    cfg = RolloutConfig(backend="cost_model")
    server = build_server(cfg, "", dtype="float32", seed=3, index=2)
    assert isinstance(server, CostModelServer) and server.seed == 5
    cfg.backend = "tensorrt"  # past the config's own check
    with pytest.raises(ValueError, match="rollout.backend: unknown rollout backend 'tensorrt'"):
        build_server(cfg, "", dtype="float32", seed=0)


class _Plain(RolloutServer):
    """An engine with the abstract verbs only: every hook is the base class's default."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[object] = []
        self.v, self.fail = -1, fail

    async def generate(self, prompt_ids, sampling, request_id=None) -> GenerateOutput:
        raise NotImplementedError

    async def pause(self, mode="wait") -> None:
        self.calls.append(("pause", mode))

    async def resume(self) -> None:
        self.calls.append("resume")

    async def update_weights(self, named_tensors, version: int) -> None:
        if self.fail:
            raise ValueError("bad tensor")
        self.calls.append(("update", named_tensors, version))
        self.v = version

    async def reset_prefix_cache(self) -> None:
        pass

    def stats(self) -> ServerStats:
        return ServerStats(self.v, 0, False, 0, 0.0)

    @property
    def version(self) -> int:
        return self.v


class _Update(list):
    """A weight-plane update stand-in: its (name, tensor) pairs, its version, and what the sender hears."""

    version = 4
    said: str = ""

    def confirm(self) -> None:
        self.said = "confirmed"

    def refuse(self, why: str) -> None:
        self.said = f"refused: {why}"


def test_the_default_hooks_load_the_pairs_whole_and_resume_after_a_failed_load():
    plain = _Plain()
    assert plain.receiver_transport(None) is None and plain.export_weights() is None and not plain.loads_in_place
    update = _Update([("w", 1.0), ("b", 2.0)])
    assert asyncio.run(apply_update(plain, update, "keep")) == 4
    assert plain.calls == [("pause", "keep"), ("update", [("w", 1.0), ("b", 2.0)], 4), "resume"]
    assert update.said == "confirmed" and plain.version == 4

    failing = _Plain(fail=True)
    update = _Update([("w", 1.0)])
    with pytest.raises(ValueError):
        asyncio.run(apply_update(failing, update, "abort"))
    assert failing.calls == [("pause", "abort"), "resume"] and update.said.startswith("refused: load: ValueError")


def test_an_engine_that_loads_in_place_stays_paused_after_a_failed_load():
    class InPlace(_Plain):
        loads_in_place = True

    server = InPlace(fail=True)
    with pytest.raises(ValueError):
        asyncio.run(apply_update(server, _Update([("w", 1.0)]), "wait"))
    assert server.calls == [("pause", "wait")]


class _Echo(_Plain):
    """A backend a user adds: its module (this class, with `from_config`) ..."""

    @classmethod
    def from_config(cls, cfg, model_path, *, dtype, seed, index=0, log_dir=None) -> "_Echo":
        server = cls()
        server.built = (cfg.backend, model_path, dtype, seed + index)
        return server


def test_a_new_backend_is_its_module_plus_one_registry_line():
    BACKENDS.add("echo", f"{__name__}:_Echo")  # ... plus this one line in engines/registry.py
    try:
        cfg = RolloutConfig(backend="echo")  # the config's check accepts the name now
        server = build_server(cfg, "/models/m", dtype="bfloat16", seed=1, index=2)
        assert isinstance(server, _Echo) and server.built == ("echo", "/models/m", "bfloat16", 3)
    finally:
        del BACKENDS._entries["echo"]
    with pytest.raises(ValueError, match="rollout.backend"):
        RolloutConfig(backend="echo")
