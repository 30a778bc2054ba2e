"""A rollout engine in a lower precision than the trainer (`rollout.dtype=bfloat16`, `model.dtype=float32`):
the torch engine runs in bfloat16, takes the float32 weights the trainer publishes (cast as they land,
through `update_weights` and through a weight-plane update's `land_into`) and serves them: its
log-probs are the float32 model's within bfloat16 rounding, and not equal to them (it computes in
bfloat16). What it must still refuse: a dtype it was not told to cast from, a non-float tensor, a shape."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config import ConfigError, RolloutConfig, load
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchRolloutServer
from checkpoint_engine.receiver import land_into

from .helpers import max_abs_diff

PROBE = [3, 17, 42, 5, 99, 64, 7, 12, 33, 2, 81, 11, 50, 9, 27, 40]


def _state(path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(path / "model.safetensors")).items())


@dataclass
class PlaneUpdate:
    """What `load_update` reads of a weight-plane `Update`: `into(dest)` yields (name, tensor), `version`.
    The tensors are the float32 ones a float32 trainer publishes (the real plane: test_weight_parity_probe)."""

    tensors: list[tuple[str, torch.Tensor]]
    version: int
    dest: dict[str, torch.Tensor] = field(default_factory=dict)

    def into(self, dest):
        self.dest = dest
        return iter(self.tensors)


@pytest.mark.timeout(120)
def test_bf16_engine_serves_fp32_published_weights_in_bf16(tiny_model, tiny_model_b):
    state_b = _state(tiny_model_b)
    assert {t.dtype for _, t in state_b} == {torch.float32}

    async def run():
        ref = TorchRolloutServer(tiny_model_b, threads=1)  # float32 on both sides: the trainer's log-probs
        want = await ref.score(PROBE)
        await ref.close()
        out = {}
        for path in ("update_weights", "load_update"):
            server = TorchRolloutServer(tiny_model, dtype="bfloat16", weights_dtype="float32", threads=1)
            before = await server.score(PROBE)
            if path == "update_weights":
                await server.update_weights(state_b, version=1)
            else:
                await server.load_update(PlaneUpdate(state_b, version=1))
            got = await server.score(PROBE)
            sample = await server.generate(PROBE[:4], SamplingParams(max_tokens=6, seed=1))
            out[path] = (before, got, dict(server._params), server.version, sample)
            await server.close()
        return want, out

    want, out = asyncio.run(run())
    weights_b = dict(state_b)
    for path, (before, got, params, version, sample) in out.items():
        assert version == 1 and set(sample.versions) == {1}, path
        assert all(p.dtype == torch.bfloat16 for p in params.values()), path
        assert all(torch.equal(params[n], weights_b[n].to(torch.bfloat16)) for n in weights_b), path  # the cast of each
        gap = max_abs_diff(got, want)
        assert 1e-6 < gap <= 0.05, (path, gap)  # bf16 arithmetic: close to fp32, not equal to it
        assert max_abs_diff(before, want) > 10 * gap, path  # the weights of b landed (a scored far from b)


def test_dtype_mismatches_the_engine_was_not_told_of_are_refused(tiny_model):
    async def run():
        server = TorchRolloutServer(tiny_model, dtype="bfloat16", threads=1)  # no weights_dtype: bf16 only
        name, w = _state(tiny_model)[0]
        with pytest.raises(ValueError, match="dtype torch.float32"):
            await server.update_weights([(name, w)], version=1)
        await server.close()
        server = TorchRolloutServer(tiny_model, dtype="bfloat16", weights_dtype="float32", threads=1)
        with pytest.raises(ValueError, match="dtype torch.float16"):  # not the trainer's dtype
            await server.update_weights([(name, w.half())], version=1)
        with pytest.raises(ValueError, match="shape"):
            await server.update_weights([(name, w[:1])], version=1)
        with pytest.raises(ValueError, match="the model's is torch.bfloat16"):
            await server.load_update(PlaneUpdate([(name, w.half())], version=1))
        await server.close()
        with pytest.raises(ValueError, match="weights_dtype"):
            TorchRolloutServer(tiny_model, dtype="bfloat16", weights_dtype="int8")

    asyncio.run(run())


def test_land_into_casts_only_the_named_float_dtype():
    dest = {"w": torch.zeros(3, dtype=torch.bfloat16), "n": torch.zeros(2, dtype=torch.float32)}
    x = torch.tensor([1.0, 1 / 3, 1e-3], dtype=torch.float32)
    assert land_into(PlaneUpdate([("w", x)], 1), dest, cast_from=torch.float32) == 1
    assert torch.equal(dest["w"], x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):  # no cast asked for: refused as before
        land_into(PlaneUpdate([("w", x)], 1), dest)
    with pytest.raises(ValueError, match="int64"):  # a non-float tensor is never cast
        land_into(PlaneUpdate([("n", torch.ones(2, dtype=torch.int64))], 1), dest, cast_from=torch.int64)
    with pytest.raises(ValueError, match=r"\(2,\)"):  # nor a shape
        land_into(PlaneUpdate([("w", x[:2])], 1), dest, cast_from=torch.float32)


def test_rollout_dtype_key(tiny_model):
    assert load(None, []).rollout.dtype == "" and RolloutConfig().engine_dtype("float32") == "float32"
    cfg = load(None, ["rollout.dtype=bfloat16", "model.dtype=float32"])
    assert cfg.rollout.engine_dtype(cfg.model.dtype) == "bfloat16"
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load(None, ["rollout.dtype=int8"])
    server = TorchRolloutServer.from_config(cfg.rollout, str(tiny_model), dtype=cfg.model.dtype, seed=0)
    assert server.cast_from == torch.float32 and next(iter(server._params.values())).dtype == torch.bfloat16
    asyncio.run(server.close())
