"""Trainer checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, LR schedule, step,
adapted entropy weight; with a critic (`algorithm.advantage=gae`) its model, optimizer, schedule and
KL-in-reward beta too (`critic.CriticState`).

Each rank writes and reads only its own shards, so a checkpoint costs no gather and
scales with the ranks; DCP reshards on load, so a run saved with N ranks resumes on M.
The files are safetensors, msgpack and JSON (`ckpt_format`): nothing is unpickled on load.
The reference model is not saved: it is always the initial weights of `model_path`.

This module knows the engine's attributes (`model`, `optimizer`, `scheduler`, `step`)
and nothing about run directories or retention (the controller owns those).

    engine.save("runs/x/checkpoints/step_20")      # every rank calls it
    fresh = TrainerEngine(path, trainer=..., algorithm=...)
    fresh.load("runs/x/checkpoints/step_20")       # fresh.step == 20, same weights and Adam moments
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from asyncrl.trainer import ckpt_format

if TYPE_CHECKING:
    from asyncrl.trainer.engine import TrainerEngine


class TrainerState(Stateful):
    """The engine's resumable state as DCP sees it; (de)serialised lazily at save/load time."""

    def __init__(self, engine: "TrainerEngine") -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        model_sd, optim_sd = get_state_dict(e.model, e.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": e.scheduler.state_dict(), "step": e.step,
                "entropy_coef": e.entropy_coef}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        e = self.engine
        set_state_dict(e.model, e.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
        e.scheduler.load_state_dict(state_dict["scheduler"])
        e.step = int(state_dict["step"])
        e.entropy_coef = float(state_dict.get("entropy_coef", e.entropy_coef))


def _states(engine: "TrainerEngine") -> dict[str, Stateful]:
    """What a checkpoint holds: the policy's state, and the critic's (`algorithm.advantage=gae`)."""
    critic = getattr(engine, "critic", None)
    if critic is None:
        return {"trainer": TrainerState(engine)}
    from asyncrl.trainer.critic import CriticState

    return {"trainer": TrainerState(engine), "critic": CriticState(critic)}


def save(engine: "TrainerEngine", path: str) -> None:
    """Write the engine's state under the folder `path` (collective: every rank calls it)."""
    dcp.save(_states(engine), storage_writer=ckpt_format.Writer(path), planner=ckpt_format.SavePlannerNoPickle())


def load(engine: "TrainerEngine", path: str) -> None:
    """Restore model, optimizer, schedule and step from `path` into an engine built with the same model
    (`ckpt_format.CheckpointFormatError`: not a checkpoint this version reads)."""
    verified = ckpt_format.verify(path)  # its one line here, before DCP would wrap it in a rank's traceback
    dcp.load(_states(engine), storage_reader=ckpt_format.Reader(path, verified), planner=ckpt_format.LoadPlannerNoPickle())
