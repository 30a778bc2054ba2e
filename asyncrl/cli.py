"""`asyncrl` command line: train, bench, config, status, export.

    asyncrl train [CONFIG.yaml] [key=value ...]   run a job (no CONFIG: the embedded demo)
    asyncrl bench rollout|queue|weights|pipeline|planes [--json]
                                                  measurements, ratios against baselines
    asyncrl bench rollout --fleet [--json]        fleet scaling over 1, 2, 4 servers
    asyncrl bench trainer [--json] [--quick]      a long-tail batch's step: padded vs packed, checkpointing
    asyncrl plan [--profile NAME] [--gpus 128,256] [--validate] [--json]
                                                  predicted throughput, staleness, best split (asyncrl/plan)
    asyncrl config [CONFIG.yaml] [key=value ...] [--doc]
                                                  print the resolved config, or document every key
    asyncrl status [--run DIR | --redis URL] [--json | --watch]
                                                  state of a run (docs/status.md)
    asyncrl export RUN_DIR [--step N] [--dtype D] OUT
                                                  a checkpoint of a run as a Hugging Face folder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

BENCHES = {
    "rollout": "asyncrl.bench.rollout",
    "queue": "asyncrl.bench.queue",
    "weights": "asyncrl.bench.weights",
    "pipeline": "asyncrl.bench.pipeline",
    "planes": "asyncrl.bench.planes",
    "chaos": "asyncrl.bench.chaos",
    "trainer": "asyncrl.bench.trainer",
}


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


def train(args: list[str]) -> int:
    from asyncrl.config import ConfigError, dump_resolved, load, to_dict
    from asyncrl.preflight import preflight
    from asyncrl.run_dir import resolve_run_dir, write_status

    if args and args[0] in ("-h", "--help"):
        print("usage: asyncrl train [CONFIG.yaml] [key=value ...]   (keys: asyncrl config --doc; resume: resume=true)")
        return 0
    path, overrides = _split(args)
    cfg = load(path, overrides)
    preflight(cfg)  # data files, model folder, tokenizer, engine: one line naming the key, before a run directory or a server
    run_dir = resolve_run_dir(cfg)
    dump_resolved(cfg, run_dir / "config.yaml")
    write_status(run_dir, state="starting", step=0)
    print(f"asyncrl: run directory {run_dir}", flush=True)
    _seed(cfg.seed)

    from asyncrl.controller import Pipeline
    from asyncrl.launch import build
    from asyncrl.metrics import MetricsLogger
    from asyncrl.trainer.handle import TrainerDied

    try:
        parts = build(cfg, run_dir)
    except ConfigError as e:  # e.g. a data file with no usable row: printed as one line by main()
        write_status(run_dir, state="failed", step=0, error=f"config error: {e}"[:500])
        raise
    metrics = MetricsLogger(cfg.logging, run_dir, to_dict(cfg))
    metrics.artifact(run_dir / "config.yaml")
    restarts = 0
    while True:
        pipeline = Pipeline(cfg, parts, run_dir, metrics)

        async def go() -> dict:
            try:
                return await pipeline.run()
            finally:
                await parts.close()

        try:
            summary = asyncio.run(go())
            break
        except TrainerDied as e:  # restart every process of the run from its last checkpoint, as resume=true
            if restarts < cfg.trainer.max_restarts:
                restarts += 1
                print(f"asyncrl: {e}; restarting from the last checkpoint ({restarts} of trainer.max_restarts="
                      f"{cfg.trainer.max_restarts})", file=sys.stderr, flush=True)
                cfg.resume = True
                parts = build(cfg, run_dir)
                continue
            write_status(run_dir, state="failed", step=pipeline.step, error=f"{type(e).__name__}: {e}"[:500])
            metrics.close("FAILED")
            raise
        except BaseException as e:
            write_status(run_dir, state="failed", step=pipeline.step, error=f"{type(e).__name__}: {e}"[:500])
            metrics.close("FAILED" if not isinstance(e, KeyboardInterrupt) else "KILLED")
            raise
    summary["trainer_restarts"] = restarts
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    metrics.artifact(run_dir / "summary.json")
    metrics.artifact(run_dir / "reward_curve.png")
    metrics.close()
    write_status(run_dir, state="finished", step=pipeline.step)
    s = {k: v for k, v in summary.items() if k != "curve"}
    print("asyncrl: finished  " + "  ".join(f"{k}={v}" for k, v in s.items()), flush=True)
    return 0


def config_cmd(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from asyncrl.config import document, load, to_dict

    if "--doc" in args:
        print("| key | default | meaning |\n|---|---|---|")
        for key, default, doc in document():
            print(f"| `{key}` | `{default}` | {doc} |")
        return 0
    path, overrides = _split(args)
    print(OmegaConf.to_yaml(OmegaConf.create(to_dict(load(path, overrides)))), end="")
    return 0


def bench(args: list[str]) -> int:
    import importlib

    if not args or args[0] not in BENCHES:
        print(f"usage: asyncrl bench {{{','.join(BENCHES)}}} [--json] [--quick]", file=sys.stderr)
        return 2
    rest = args[1:]
    name = BENCHES[args[0]]
    if args[0] == "rollout" and "--fleet" in rest:  # scaling over 1, 2, 4 servers instead of engines
        name, rest = "asyncrl.bench.fleet", [a for a in rest if a != "--fleet"]
    return int(importlib.import_module(name).main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "status":  # reads a snapshot only: answers without importing torch
        from asyncrl.observe.command import main as status_main

        return status_main(argv[1:])
    from agents.base import RewardBroken
    from asyncrl.config import ConfigError
    from asyncrl.rollout.parity import WeightParityError

    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "bench", "plan", "config", "status", "export"])
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            return train(rest)
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
        print(f"asyncrl: config error: {e}", file=sys.stderr)
        return 2
    except (RewardBroken, WeightParityError) as e:  # the run stopped on purpose; through Ray the text ends with the cause's own
        print(f"asyncrl: stopped: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {cmd!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
