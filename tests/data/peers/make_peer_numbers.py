"""Make the peers' numbers that tests/unit/trainer/test_peer_equivalence.py checks asyncrl against.

Run by hand (needs PyPI, nothing else): `.venv/bin/python tests/data/peers/make_peer_numbers.py`. It
`pip download --no-deps`s the pinned wheels of verl and AReaL into a temporary folder, unpacks them, loads only
the modules that hold the functions (verl: `verl/utils/torch_functional.py`, `verl/trainer/ppo/rollout_corr_helper.py`,
`verl/trainer/ppo/core_algos.py`; AReaL: `areal/utils/functional/functional.py`, and the M2PO functions of
`areal/trainer/ppo/actor.py`), runs them on fixed seeded fp64 inputs and writes `<peer>_<version>.json` here:
per case the peer, its version, the function run, the settings, the inputs and the outputs (effective per-token
weight, per-token loss, the loss, its gradient w.r.t. the current log-probs, and the peer's loss normaliser).

What is stubbed, and why (no peer code is rewritten; the functions run are the wheels' own):
- verl: the package `__init__`s import ray, transformers, tensordict and the whole worker stack. The three modules
  are loaded from their files under their own names; the modules they import only for type annotations or
  unrelated helpers (`verl.protocol.DataProto`, `verl.trainer.config`, `verl.workers.config`, `verl.utils`,
  `verl.utils.device`, `verl.utils.import_utils.deprecated`, `tensordict`) are small stand-ins in `sys.modules`.
  `DataProto.from_dict` is stood in by an object with `.batch` (how the helper returns its weights). The
  policy losses' `config` is a stand-in with verl's attribute names (`clip_ratio*`, `policy_loss.*`,
  `global_batch_info={}`: one data-parallel rank, the micro-batch's own token count).
- AReaL: `areal/api/cli_args.py` imports hydra and uvloop at the top; its `RejectionSamplingConfig` dataclass
  is taken from that file's source (ast) and executed alone, and `functional.py` is loaded with it in a stand-in
  `areal.api.cli_args` (and a stand-in `areal.utils.data.KLEstimator`, used only by the KL metrics, not run
  here). `actor.py` imports the whole trainer; its `_apply_m2po_masking` and `_get_m2po_loss_mask` are taken
  from its source (ast) and executed alone, then composed with `ppo_actor_loss_fn` as `grpo_loss_fn` does.
  AReaL's `apply_rejection_sampling` casts the log ratio to float32: its weights are fp32-exact only.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch

VERL, AREAL = "0.9.1", "1.0.4"
HERE = Path(__file__).resolve().parent
B, T = 6, 8


def download(name: str, version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{name}=={version}", "-d", str(into)],
                   check=True, capture_output=True)
    wheel = next(into.glob(f"{name}-{version}-*.whl"))
    out = into / name
    zipfile.ZipFile(wheel).extractall(out)
    return out


def stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that submodules can be registered under it
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def from_source(path: Path, names: list[str], env: dict) -> dict:
    """Execute only the top-level definitions `names` of the file at `path` in `env`."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if getattr(n, "name", None) in names]
    assert len(body) == len(names), f"{path}: found {[n.name for n in body]} of {names}"
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), env)
    return env


class Cfg(dict):
    """verl's config object: attributes and `.get`."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


def load_verl(root: Path):
    class DataProto:
        def __init__(self, batch):
            self.batch = batch

        @classmethod
        def from_dict(cls, tensors):
            return cls(dict(tensors))

    stub("tensordict", TensorDict=dict)
    for pkg in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.workers"):
        stub(pkg)
    stub("verl.utils", as_torch_index=None, group_mean_std=None)
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    stub("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda f: f))
    stub("verl.protocol", DataProto=DataProto)
    stub("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {}))
    stub("verl.trainer.config.algorithm", RolloutCorrectionConfig=Cfg)
    stub("verl.workers.config", ActorConfig=Cfg)
    stub("verl.workers.config.actor", PolicyLossConfig=Cfg)
    vf = load("verl.utils.torch_functional", root / "verl/utils/torch_functional.py")
    sys.modules["verl.utils"].torch_functional = vf
    helper = load("verl.trainer.ppo.rollout_corr_helper", root / "verl/trainer/ppo/rollout_corr_helper.py")
    core = load("verl.trainer.ppo.core_algos", root / "verl/trainer/ppo/core_algos.py")
    return helper, core


def load_areal(root: Path):
    import dataclasses
    from dataclasses import dataclass, field

    for pkg in ("areal", "areal.api", "areal.utils", "areal.utils.functional"):
        stub(pkg)
    cli = stub("areal.api.cli_args", dataclass=dataclass, field=field)  # the class is defined in it, as dataclasses expects
    env = from_source(root / "areal/api/cli_args.py", ["RejectionSamplingConfig"], cli.__dict__)
    stub("areal.utils.data", KLEstimator=None)
    functional = load("areal.utils.functional.functional", root / "areal/utils/functional/functional.py")
    m2 = from_source(root / "areal/trainer/ppo/actor.py", ["_apply_m2po_masking", "_get_m2po_loss_mask"], {"torch": torch})
    assert dataclasses.is_dataclass(env["RejectionSamplingConfig"])
    return functional, env["RejectionSamplingConfig"], m2["_apply_m2po_masking"]


def inputs(seed: int, stale: float = 0.05, drift: float = 0.1) -> dict[str, torch.Tensor]:
    """behav (rollout), prox (old / proximal), logp (current) log-probs, advantages and a mask with ragged rows."""
    g = torch.Generator().manual_seed(seed)
    behav = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    prox = behav + stale * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = prox + drift * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([8, 5, 8, 3, 6, 8])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return {"behav": behav, "prox": prox, "logp": logp, "adv": adv.contiguous(), "mask": mask}


def record(x: dict[str, torch.Tensor], **out) -> dict:
    return {"inputs": {k: v.tolist() for k, v in x.items()},
            "outputs": {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}}


def capture_agg(core):
    """Wrap verl's `agg_loss` to keep the per-token loss matrix and mask it aggregated (its own call is unchanged)."""
    seen = {}
    real = core.agg_loss

    def agg(loss_mat, loss_mask, loss_agg_mode, **kw):
        seen["mat"], seen["mask"] = loss_mat.detach().clone(), loss_mask.detach().clone()
        return real(loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=loss_agg_mode, **kw)

    core.agg_loss = agg
    return seen


def ppo_cfg(**policy_loss) -> Cfg:
    return Cfg(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, global_batch_info={},
               policy_loss=Cfg(**policy_loss))


def verl_cases(helper, core) -> list[dict]:
    seen = capture_agg(core)
    cases = []
    decoupled = [  # (asyncrl name, settings, verl rollout_correction keys, input seed)
        ("token_tis", {"threshold": 1.03}, dict(rollout_is="token", rollout_is_threshold=1.03), 1),
        ("seq_tis", {"threshold": 1.1}, dict(rollout_is="sequence", rollout_is_threshold=1.1), 2),
        ("seq_mis", {"threshold": 1.1, "low": 0.9, "high": 1.1},
         dict(rollout_is="sequence", rollout_is_threshold=1.1, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.9_1.1"), 3),
        ("icepop", {"low": 0.95, "high": 1.05}, dict(rollout_is="token", rollout_is_threshold="0.95_1.05"), 4),
        ("geo_rs", {"low": 0.98, "high": 1.02}, dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.98_1.02"), 5),
        ("geo_rs", {"low": 0.98, "high": 1.02, "tis": "sequence", "tis_threshold": 1.05},
         dict(rollout_is="sequence", rollout_is_threshold=1.05, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.98_1.02"), 6),
        ("k3_rs", {"threshold": 0.0012}, dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.0012), 7),
        ("k3_rs", {"threshold": 0.0012, "tis": "token", "tis_threshold": 1.03},
         dict(rollout_is="token", rollout_is_threshold=1.03, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.0012), 8),
    ]
    for name, settings, keys, seed in decoupled:
        x = inputs(seed)
        proto, new_mask, _ = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=x["prox"], rollout_log_prob=x["behav"], response_mask=x["mask"], **keys)
        w = proto.batch["rollout_is_weights"] if proto is not None else None
        logp = x["logp"].clone().requires_grad_(True)
        loss, _ = core.compute_policy_loss_vanilla(old_log_prob=x["prox"], log_prob=logp, advantages=x["adv"], response_mask=new_mask,
                                                   loss_agg_mode="token-mean", config=ppo_cfg(), rollout_is_weights=w)
        loss.backward()
        eff = (w if w is not None else torch.ones_like(new_mask)) * new_mask
        cases.append({"peer": "verl", "version": VERL, "function": "rollout_corr_helper.compute_rollout_correction_and_rejection_mask"
                      " + core_algos.compute_policy_loss_vanilla", "peer_settings": keys, "correction": name, "correction_args": settings,
                      "loss": "ppo_clip", "loss_args": {}, **record(x, weight=eff, token_loss=seen["mat"] * seen["mask"], value=loss.item(),
                                                                    grad=logp.grad, denominator=new_mask.sum().item())})
    bypass = [
        ("seq_tis", {"threshold": 1.1, "form": "bypass"}, dict(rollout_is="sequence", rollout_is_threshold=1.1, loss_type="reinforce"), "reinforce", 11),
        ("icepop", {"low": 0.9, "high": 1.1, "form": "bypass"}, dict(rollout_is="token", rollout_is_threshold="0.9_1.1", loss_type="reinforce"), "reinforce", 12),
        ("geo_rs", {"low": 0.97, "high": 1.03, "form": "bypass"}, dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.97_1.03", loss_type="ppo_clip"), "ppo_clip", 13),
        ("k3_rs", {"threshold": 0.004, "form": "bypass"}, dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.004, loss_type="ppo_clip"), "ppo_clip", 14),
    ]
    for name, settings, keys, loss_name, seed in bypass:
        x = inputs(seed, drift=0.08)
        logp = x["logp"].clone().requires_grad_(True)
        loss, _ = core.compute_policy_loss_bypass_mode(old_log_prob=x["behav"], log_prob=logp, advantages=x["adv"], response_mask=x["mask"],
                                                       loss_agg_mode="token-mean", config=ppo_cfg(rollout_correction=Cfg(**keys)))
        loss.backward()
        with torch.no_grad():  # the weight the bypass loss applied: verl's helper on the same detached inputs
            proto, new_mask, _ = helper.compute_rollout_correction_and_rejection_mask(
                old_log_prob=x["logp"], rollout_log_prob=x["behav"], response_mask=x["mask"],
                **{k: v for k, v in keys.items() if k != "loss_type"})
        w = proto.batch["rollout_is_weights"] if proto is not None and loss_name == "reinforce" else torch.ones_like(new_mask)
        cases.append({"peer": "verl", "version": VERL, "function": f"core_algos.compute_policy_loss_bypass_mode (loss_type={keys['loss_type']})",
                      "peer_settings": keys, "correction": name, "correction_args": settings, "loss": loss_name, "loss_args": {},
                      **record(x, weight=w * new_mask, token_loss=seen["mat"] * seen["mask"], value=loss.item(), grad=logp.grad,
                               denominator=new_mask.sum().item())})
    losses = [("clip_cov", dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0), core.compute_policy_loss_clip_cov, 21),
              ("kl_cov", dict(kl_cov_ratio=0.1, ppo_kl_coef=1.0), core.compute_policy_loss_kl_cov, 22)]
    for name, settings, fn, seed in losses:
        x = inputs(seed, drift=0.2)
        logp = x["logp"].clone().requires_grad_(True)
        torch.manual_seed(seed)  # clip_cov's torch.randperm: the test seeds the same before asyncrl's call
        loss, _ = fn(old_log_prob=x["behav"], log_prob=logp, advantages=x["adv"], response_mask=x["mask"], loss_agg_mode="token-mean",
                     config=ppo_cfg(**settings))
        loss.backward()
        cases.append({"peer": "verl", "version": VERL, "function": f"core_algos.{fn.__name__}", "peer_settings": settings,
                      "correction": "none", "correction_args": {}, "loss": name, "loss_args": settings, "rng_seed": seed,
                      **record(x, weight=x["mask"], token_loss=seen["mat"] * seen["mask"], value=loss.item(), grad=logp.grad,
                               denominator=x["mask"].sum().item())})
    return cases


def areal_cases(functional, RS, apply_m2po) -> list[dict]:
    cases = []
    x = inputs(31)
    rs = RS(level="token", action="mask", metric="ratio", lower=0.95, upper=1.05)
    logp = x["logp"].clone().requires_grad_(True)
    loss, stat = functional.ppo_actor_loss_fn(logprobs=logp, proximal_logprobs=x["prox"], old_logprobs=x["behav"], advantages=x["adv"],
                                              eps_clip=0.2, loss_mask=x["mask"].bool(), c_clip=3.0, rejection_sampling=rs)
    loss.backward()
    cases.append({"peer": "areal", "version": AREAL, "function": "areal.utils.functional.ppo_actor_loss_fn (rejection_sampling: token ratio mask)",
                  "peer_settings": {"level": "token", "action": "mask", "metric": "ratio", "lower": 0.95, "upper": 1.05, "eps_clip": 0.2, "c_clip": 3.0},
                  "correction": "icepop", "correction_args": {"low": 0.95, "high": 1.05}, "loss": "ppo_clip", "loss_args": {},
                  **record(x, weight=stat["behave_imp_weight"].double(), token_loss=torch.where(x["mask"].bool(), stat["loss"], 0.0),
                           value=loss.item(), grad=logp.grad, denominator=x["mask"].sum().item())})
    x = inputs(32)
    kept = apply_m2po(x["behav"], x["prox"], x["mask"].bool(), 0.0015)
    logp = x["logp"].clone().requires_grad_(True)
    loss, stat = functional.ppo_actor_loss_fn(logprobs=logp, proximal_logprobs=x["prox"], old_logprobs=x["behav"], advantages=x["adv"],
                                              eps_clip=0.2, loss_mask=kept, c_clip=3.0, rejection_sampling=None)
    loss.backward()
    cases.append({"peer": "areal", "version": AREAL, "function": "areal.trainer.ppo.actor._apply_m2po_masking + ppo_actor_loss_fn (as grpo_loss_fn)",
                  "peer_settings": {"m2_threshold": 0.0015, "eps_clip": 0.2, "c_clip": 3.0}, "correction": "m2po",
                  "correction_args": {"m2_threshold": 0.0015}, "loss": "ppo_clip", "loss_args": {},
                  **record(x, weight=kept.double(), token_loss=torch.where(kept, stat["loss"], 0.0), value=loss.item(), grad=logp.grad,
                           denominator=kept.sum().item())})
    return cases


def main() -> None:
    torch.set_default_dtype(torch.float64)
    with tempfile.TemporaryDirectory() as tmp:
        verl_root = download("verl", VERL, Path(tmp))
        areal_root = download("areal", AREAL, Path(tmp))
        helper, core = load_verl(verl_root)
        functional, RS, apply_m2po = load_areal(areal_root)
        for peer, version, cases in (("verl", VERL, verl_cases(helper, core)), ("areal", AREAL, areal_cases(functional, RS, apply_m2po))):
            path = HERE / f"{peer}_{version}.json"
            path.write_text(json.dumps({"peer": peer, "version": version, "torch": torch.__version__, "dtype": "float64",
                                        "made_by": "tests/data/peers/make_peer_numbers.py", "cases": cases}, separators=(",", ":")))
            print(f"{path}: {len(cases)} cases, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
