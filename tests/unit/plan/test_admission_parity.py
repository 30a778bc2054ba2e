"""One config, one admission: the controller and the simulator build the same machinery for every mode.

The controller builds its manager as `StalenessManager.for_rule(cfg.trainer.rule, batch_groups=
trainer.prompts_per_step)` (`Pipeline.__init__`); the simulator builds its own from the
`Schedule` of the same config's sections (`Schedule.of_run`, what `asyncrl plan` reads from a
run's resolved `config.yaml`). Both go through `asyncrl.admission.mode_rule`.
"""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config import load
from asyncrl.engines.cost_model import LongTail
from asyncrl.plan.costs import Costs
from asyncrl.plan.schedule import MODES, Schedule
from asyncrl.plan.sim import Simulator
from asyncrl.staleness import StalenessManager

EXPECTED = {  # (eta, publish_every, in_order, paced) of each mode with max_staleness=3, publish_every=2
    "sync": (0, 1, True, False),
    "one_step_off": (1, 1, True, False),
    "fully_async": (3, 2, False, True),
}


def machinery(mgr: StalenessManager, publish_every: int) -> dict:
    p = mgr.pace
    return {"batch_groups": mgr.batch_groups, "eta": mgr.eta, "in_order": mgr.in_order, "publish_every": publish_every,
            "pace": None if p is None else (type(p).__name__, p.B, p.eta, p.slack)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("admission", ["pace", "bound"])
@pytest.mark.parametrize("mode", MODES)
def test_the_controller_and_the_simulator_build_the_same_admission_from_one_config(mode, admission):
    cfg = load(None, [f"trainer.mode={mode}", "trainer.max_staleness=3", "trainer.publish_every=2",
                      f"trainer.admission={admission}", "trainer.admission_slack=0.5", "trainer.prompts_per_step=3"])
    rule = cfg.trainer.rule
    controller = machinery(StalenessManager.for_rule(rule, batch_groups=cfg.trainer.prompts_per_step), rule.publish_every)

    sections = dataclasses.asdict(cfg)
    schedule = Schedule.of_run(sections["trainer"], sections["rollout"], steps=1, warmup=1)
    costs = Costs(servers=1, max_concurrency=4, token_cost_s=0.001, lengths=LongTail(short_tokens=8), trainer_tokens_per_s=1e4,
                  groups=cfg.trainer.prompts_per_step, group_size=cfg.rollout.group_size, publish_s=0.001)
    sim = Simulator(costs, schedule)
    assert machinery(sim.mgr, sim.k) == controller
    assert schedule.rule == rule and sim.eta == cfg.trainer.eta

    eta, every, in_order, paced = EXPECTED[mode]
    paced = paced and admission == "pace"
    assert controller == {"batch_groups": 3, "eta": eta, "in_order": in_order, "publish_every": every,
                          "pace": ("Pace", 3, eta, 0.5) if paced else None}
