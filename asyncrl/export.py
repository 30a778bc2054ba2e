"""`asyncrl export RUN_DIR [--step N] [--dtype D] OUT`: a trained policy as a Hugging Face folder.

Job: read the policy weights of one trainer checkpoint (torch.distributed.checkpoint in `trainer.ckpt_format`, under
`RUN_DIR/checkpoints/step_N/trainer`; the newest complete one when no step is given) into a
plain state dict, in this process and without a process group, and write them with the
run's model config, tokenizer (chat template included) and generation config as a folder
that `transformers` (`from_pretrained`) and vLLM load: `config.json`, `model.safetensors`
(sharded with an index when large), tokenizer files, `generation_config.json` (the base model's,
with the run's answer limits: `max_new_tokens` = `rollout.max_tokens`, `stop_strings` = `rollout.stop`;
see `generation_limits`), `asyncrl_export.json` (run, step, checkpoint, dtype, those limits). Every
file gets the mode of a new file under the exporting process's umask (0644 under 022).

Boundary: the run's resolved `config.yaml` says which model the run started from
(`model.path`, or the demo model built under `model.cache_dir`); that folder supplies the
architecture and tokenizer, the checkpoint supplies every weight. Only the model entries
of the checkpoint are read (not the optimizer state). A LoRA run (`model.lora_rank` > 0) is
written merged: plain weights under the base model's names (W + lora_alpha / lora_rank * B @ A),
no adapter files. Nothing about the run is changed.

    asyncrl export runs/fully_async-20250101-120000 exported/       # newest checkpoint
    asyncrl export runs/r --step 20 --dtype bfloat16 exported/
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

MODEL_PREFIX = "trainer.model."
"""Where the policy weights sit in a trainer checkpoint (`trainer.checkpoint.TrainerState`: {"trainer": {"model": ...}})."""
DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """What `asyncrl export` cannot do, as one line naming what is missing."""


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """`RUN_DIR/checkpoints/step_N` (complete: its state.json is written last), or the newest one."""
    from asyncrl.run_dir import checkpoint_dir, latest_checkpoint

    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
    steps = ", ".join(str(int(p.name.split("_")[1])) for p in done) or "none"
    if step is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ExportError(f"{run_dir}: no checkpoint under {run_dir / 'checkpoints'} (a run saves one every "
                              "trainer.save_every steps and at its end)")
    else:
        ckpt = checkpoint_dir(run_dir, step)
        if not (ckpt / "state.json").exists():
            raise ExportError(f"--step {step}: no complete checkpoint {ckpt} (steps with one: {steps})")
    from asyncrl.config import ConfigError
    from asyncrl.run_dir import check_own_tree
    from asyncrl.trainer.ckpt_format import CheckpointFormatError, refuse_other_format

    try:  # another user's files are not read at all, whatever their format
        check_own_tree(ckpt, "checkpoint")
        refuse_other_format(ckpt / "trainer")
    except (ConfigError, CheckpointFormatError) as e:
        raise ExportError(str(e)) from None
    return ckpt


def load_policy_weights(trainer_dir: Path) -> dict[str, "object"]:
    """HF parameter name -> full tensor, from a DCP trainer checkpoint (any number of saving ranks; read
    without unpickling anything: `trainer.ckpt_format`)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from asyncrl.trainer.ckpt_format import CheckpointFormatError, LoadPlannerNoPickle, Reader, verify

    try:
        verified = verify(trainer_dir)
    except CheckpointFormatError as e:
        raise ExportError(str(e)) from None
    reader, meta = Reader(trainer_dir, verified), verified.state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
          if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise ExportError(f"{trainer_dir}: the checkpoint holds no model weights (no {MODEL_PREFIX}* entries)")
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": loading in one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(sd, storage_reader=reader, planner=LoadPlannerNoPickle(), no_dist=True)
        except CheckpointFormatError as e:
            raise ExportError(str(e)) from None
    return {k[len(MODEL_PREFIX):]: v for k, v in sd.items()}


def run_config(run_dir: Path) -> "object":
    """The run's resolved config (`RUN_DIR/config.yaml`)."""
    from asyncrl.config import load

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise ExportError(f"{run_dir}: not a run directory (no config.yaml)")
    return load(str(cfg_file))


def run_model(run_dir: Path, cfg: "object | None" = None) -> tuple[str, str]:
    """(model folder, `model.dtype`) the run started from, per its resolved config `cfg` (read from `run_dir` when
    not given; the demo model is rebuilt if its cache is gone: it is deterministic)."""
    from asyncrl.launch import resolve_model_path

    cfg = cfg if cfg is not None else run_config(run_dir)
    path = resolve_model_path(cfg)
    if not (Path(path) / "config.json").exists():
        raise ExportError(f"model.path: {path} (from {run_dir / 'config.yaml'}) has no config.json; the run's model folder is needed "
                          "for its architecture and tokenizer")
    return path, cfg.model.dtype  # type: ignore[attr-defined]


def generation_limits(gen: "object", rollout: "object") -> dict[str, object]:
    """Set on `gen` (the exported `generation_config.json`) where the run's answers ended: `max_new_tokens` =
    `rollout.max_tokens` (every response of the run was cut there: the demo's 4-digit answers never learn an
    EOS, so without it `generate` runs past the answer) and `stop_strings` = `rollout.stop` when the run had any.
    EOS ids and sampling settings stay the base model's. Returns what was set (recorded in asyncrl_export.json)."""
    limits: dict[str, object] = {"max_new_tokens": int(rollout.max_tokens)}  # type: ignore[attr-defined]
    if rollout.stop:  # type: ignore[attr-defined]
        limits["stop_strings"] = list(rollout.stop)  # type: ignore[attr-defined]
    for k, v in limits.items():
        setattr(gen, k, v)
    return limits


def merged_lora(weights: dict[str, "object"], run_dir: Path, model: "object") -> dict[str, "object"]:
    """The checkpoint's weights under the base model's names: a LoRA run's adapters merged in (`trainer.lora`);
    `model` is the run's `model` config section."""
    from asyncrl.trainer.lora import is_adapter_key, merge_state_dict

    if not any(is_adapter_key(k) for k in weights):
        return weights
    if not model.lora_rank:  # type: ignore[attr-defined]
        raise ExportError(f"{run_dir}: the checkpoint holds LoRA adapters but config.yaml has model.lora_rank=0")
    return merge_state_dict(weights, model.lora_alpha / model.lora_rank)  # type: ignore[arg-type]


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None) -> Path:
    """Write the HF folder `out` from a checkpoint of `run_dir`; returns `out`. `dtype` None: the run's `model.dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty folder")
    ckpt = find_checkpoint(run_dir, step)
    cfg = run_config(run_dir)  # read once: the model, its dtype, LoRA, where answers ended
    model_path, run_dtype = run_model(run_dir, cfg)
    dtype = dtype or run_dtype
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    weights = load_policy_weights(ckpt / "trainer")
    weights = merged_lora(weights, run_dir, cfg.model)  # type: ignore[attr-defined]

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(weights, strict=False, assign=True)
    if result.unexpected_keys:
        raise ExportError(f"{ckpt}: weights {result.unexpected_keys[:3]} do not fit the model of {model_path}")
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ExportError(f"{ckpt}: no weights for {missing[:3]} of the model of {model_path}")
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    gen = Path(model_path) / "generation_config.json"
    model.generation_config = GenerationConfig.from_pretrained(model_path) if gen.exists() else GenerationConfig.from_model_config(config)
    trained_as = generation_limits(model.generation_config, cfg.rollout)  # type: ignore[attr-defined]

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
    state = json.loads((ckpt / "state.json").read_text())
    (tmp / "asyncrl_export.json").write_text(json.dumps(
        {"run_dir": str(run_dir.resolve()), "step": state["step"], "checkpoint": str(ckpt.resolve()), "base_model": model_path,
         "dtype": dtype, "generation": trained_as}, indent=1))
    mode = (tmp / "asyncrl_export.json").stat().st_mode & 0o777  # a new file's mode under this process's umask
    for f in tmp.iterdir():  # transformers writes weight shards through a private (0600) temp file
        f.chmod(mode)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def main(args: list[str]) -> int:
    """`asyncrl export` arguments -> exit status; an `ExportError` is printed as one line."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="asyncrl export", description="Write a run's trained policy as a Hugging Face folder.")
    p.add_argument("run_dir", help="the run directory (logging.run_root/<run name>)")
    p.add_argument("out", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="weights' dtype (default: the run's model.dtype)")
    a = p.parse_args(args)
    try:
        path = export(a.run_dir, a.out, step=a.step, dtype=a.dtype)
    except ExportError as e:
        print(f"asyncrl: export: {e}", file=sys.stderr)
        return 2
    meta = json.loads((path / "asyncrl_export.json").read_text())
    print(f"asyncrl: exported step {meta['step']} of {a.run_dir} to {path}", flush=True)
    return 0
