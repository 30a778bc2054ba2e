"""Rollout fleets: the servers that serve one run, grouped, placed, restarted and synced.

Job: building servers is engines/backends.py (`build_server`), starting them fleet_build.py (`build_fleet`,
`Fleet`). The `FleetManager` owns every
fleet of a run, the version each server serves and the rejoin rule: it adds and drains fleets
while requests run, has the trainer publish each version to exactly the servers that take
requests (weights travel trainer -> server on the weight plane, never through this process),
and restarts a server the router found dead, giving it the current weights before it takes a
request again.
Its parts, one reason to change each (mixins on one shared state; `fleet_state.py` says why):
- `fleet_state.py`: the state they share (server set, version, weight source, lock, books) and lookups;
- `fleet_weights.py`: the weight plane: attach a source, publish, parity, re-sync a server that missed one;
- `fleet_members.py`: fleets added and removed, `resize` (joins from a peer, drains);
- `fleet_health.py`: deaths, restarts, `watch`, the background work and the error that stops the run.
This module combines them and adds what a run asks of the whole (`spawn`, `stats`, `close`).
Boundary: routing lives in router.py, the Ray shell in server_actor.py (imported only when a
fleet of actors is spawned, so this module stays importable without Ray).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.config import RolloutConfig
from asyncrl.engines.base import RolloutServer
from asyncrl.rollout.fleet_build import Fleet, fleet_configs
from asyncrl.rollout.fleet_health import FleetHealth
from asyncrl.rollout.fleet_members import FleetMembership
from asyncrl.rollout.fleet_state import WeightSource, server_name
from asyncrl.rollout.fleet_weights import FleetWeights
from asyncrl.rollout.router import Router

__all__ = ["FleetManager", "WeightSource", "server_name"]

EVENTS_SHOWN = 10
"""A fleet's latest joins, drains, preemptions and restarts shown by `asyncrl status`."""


class FleetManager(FleetWeights, FleetMembership, FleetHealth):
    """The one owner of the server set and of the version each serves: a server takes requests
    only at the current version, and a publish goes to exactly the servers that take requests.

    Trace: fleets main (s0, s1) join the weight plane; publish(v0) -> the trainer sends v0 to
    {s0, s1}, both load it, manager.version = 0; s1's actor dies mid-sample -> router takes s1
    out, on_dead -> restart: fresh s1' joins the weight plane -> sync(s1') (the trainer re-sends
    the current version to it alone) -> s1' holds v0 -> router.add(s1'). publish(v1) reaches
    only the routed servers; one that did not load it (evicted: too slow, refused) is taken out
    of routing, re-synced, and routed again (restarted if the sync fails too). add_fleet(f)
    joins and syncs f first; remove_fleet(f) drains f's servers before closing them.

        manager = FleetManager(Router())
        await manager.add_fleet(await Fleet.spawn("main", cfg, path, dtype="float32", seed=0, spec=spec))
        await manager.attach_weights(trainer, cfg.weights, pause_mode="keep")
        await manager.publish(0)
        out = await manager.router.call(lambda s: s.run_sample(sample))
    """

    @classmethod
    async def spawn(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int,
                    spec: dict[str, Any] | None = None, router: Router | None = None,
                    detached: Any = None, orphan_timeout_s: float = 300.0) -> "FleetManager":
        """Every fleet of `cfg` (`main` + `rollout.fleets`) as Ray actors, behind one router (built
        from the rollout keys unless given). Fleet k's servers draw seeds from `seed + 1000 * k + index`.
        `detached` (`orphan.DetachedNames`): they outlive this process, and the ones still running from
        a controller that died are taken back (`Fleet.spawn`)."""
        if router is None:
            router = Router(max_failovers=cfg.max_failovers, partial_rollouts=cfg.partial_rollouts)
        manager = cls(router, restart_dead=cfg.restart_dead_servers)
        named = list(fleet_configs(cfg).items())
        fleets = await asyncio.gather(*(Fleet.spawn(name, c, model_path, dtype=dtype, seed=seed + 1000 * k, spec=spec,
                                                    detached=detached, orphan_timeout_s=orphan_timeout_s)
                                        for k, (name, c) in enumerate(named)))
        for fleet in fleets:
            await manager.add_fleet(fleet)
        for (name, c), fleet in zip(named, fleets):  # a resume's servers that were gone: started while the run goes on
            if len(fleet.servers) < c.num_servers:
                manager._background(manager.resize(name, c.num_servers))
        return manager

    @property
    def servers(self) -> list[RolloutServer]:
        """Every server of every fleet (routed or not)."""
        return [s for f in self.fleets.values() for s in f.servers]

    def answering(self) -> list[RolloutServer]:
        """`servers` less those known dead or hung, or silent on the weight plane and not yet probed: what a
        checkpoint asks for its partial samples (a hung one would hold it `rollout.health_timeout_s`)."""
        return [s for s in self.servers if s not in self._silent]

    def metrics(self) -> dict[str, float]:
        """`fleet/*` for the run's step log (`FleetLog.metrics`)."""
        return self.changes.metrics(self.size())

    def take_events(self) -> list[dict[str, Any]]:
        """Events since the last call (the controller logs them to metrics.jsonl)."""
        return self.changes.take()

    async def stats(self) -> dict[str, Any]:
        """Per fleet and per server: health, in-flight, version, tokens/s, data-plane arena waits; plus totals. An observer's
        verb: it never raises the manager's error (the health loop, `watch`, does)."""
        fleets: dict[str, Any] = {}
        for name, fleet in self.fleets.items():
            rows = []
            gaps = self.parity.gaps if self.parity is not None else {}
            for s in fleet.servers:
                st = await s.refresh() if hasattr(s, "refresh") else s.stats()
                parity = gaps.get(server_name(s))
                rows.append({"name": getattr(s, "name", f"{name}-{len(rows)}"), "healthy": st.healthy,
                             "routed": s in self.router.servers, "in_flight": st.in_flight, "version": st.version,
                             "paused": st.paused, "tokens_per_s": st.tokens_per_s, "generated_tokens": st.generated_tokens,
                             "arena_waits": st.arena_waits, "arena_wait_s": round(st.arena_wait_s, 3),
                             "arena_waiting": st.arena_waiting,
                             "parity_max_abs": parity[1] if parity else None, "parity_version": parity[0] if parity else None})
            self.changes.note_sizes(self.size())
            fleets[name] = {
                "servers": rows, "healthy": sum(r["healthy"] for r in rows),
                "in_flight": sum(r["in_flight"] for r in rows), "tokens_per_s": sum(r["tokens_per_s"] for r in rows),
                "arena_waiting": sum(r["arena_waiting"] for r in rows),
                "size": sum(r["routed"] for r in rows), "target": self.targets.get(name, len(fleet.servers)),
                "history": [list(h) for h in self.history.get(name, [])],
                "events": [{k: v for k, v in e.items() if k != "size"} for e in self.events if e["fleet"] == name][-EVENTS_SHOWN:],
                **({"autoscale": dict(self.autoscale)} if self.autoscale is not None and name == "main" else {}),
            }
        return {"version": self.version, "fleets": fleets, "restarts": self.restarts, "resyncs": self.resyncs, "probe_failures": self.probe_failures,
                "failovers": self.router.failovers, "resubmits": self.router.resubmits, "joins": dict(self.joins)}

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await asyncio.gather(*(f.close() for f in self.fleets.values()))
        self.fleets.clear()
