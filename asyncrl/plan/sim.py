"""A discrete-event simulator of the pipeline, whose admission is the real `StalenessManager`.

Job: replay what `asyncrl.controller.Pipeline` does on a `Costs` load, in simulated seconds, fast
(a 1,024-GPU step in milliseconds). The parts and the rules they follow:

- rollouter: starts a group while fewer samples run than the fleet's slots
  (`rollout.max_running_samples` = servers x max_concurrency) *and* `StalenessManager.can_start()`;
  then `acquire()` (the real one). A sample goes to the server with the fewest requests in flight
  and, once it holds one of that server's slots, generates a token every `Costs.token_cost_at(a)`
  seconds while `a` samples run there: each server has its own clock, which runs at
  `token_cost_s / token_cost_at(a)` of the rollout clock and is re-timed at every start and end on
  it (`token_cost_slope_s` 0: every server's clock is the rollout clock, as before).
- queue: a finished group is queued with the version of its oldest token; the trainer takes B
  groups oldest first, none newer than `takeable_version()` in order, dropping (counted, through
  `drop_accepted`) the ones whose staleness at its step would exceed eta, as the memory metadata
  store's `_take` does.
- trainer: `took(B)`, trains `tokens / trainer_tokens_per_s + step_overhead_s`, publishes every k
  steps (`publish_s`, every server paused: the cost model's `keep` pause freezes its clock), then
  `set_version` and `step_done(busy, wait)`, in `_train_loop`'s order.
- contention (`Costs.contention`, 1 = none): while the trainer trains and any server generates,
  both run at 1/contention of their speed (rollout and trainer sharing a host's CPUs, as the
  embedded demo does; separate GPUs share nothing and keep 1).

The manager is driven synchronously: none of its calls made here ever waits (the simulator only
calls `acquire` when `can_start()` holds), so each coroutine runs to its end in one `send`. The
manager reads `time.monotonic()` only for the pace's latencies and its idle seconds; `_SimPace`
feeds the pace the simulated latency instead (same first-in-first-out match per version as the
manager's), and idle ratios are measured here. What it does not model: prefill, KV-cache limits,
event-loop lag of a loaded host; with a slope, `request_overhead_s` is stretched like the tokens.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Coroutine

from asyncrl.admission import Pace
from asyncrl.plan.costs import Costs
from asyncrl.staleness import StalenessManager
from transfer_queue.rules import staleness

MODES = ("sync", "one_step_off", "fully_async")


@dataclass
class Schedule:
    mode: str = "fully_async"
    eta: int = 4
    """trainer.max_staleness of fully_async (sync: 0, one_step_off: 1)."""
    publish_every: int = 1
    admission: str = "pace"
    """trainer.admission of fully_async: `pace` or `bound`."""
    slack: float = 0.25
    steps: int = 20
    """Measured trainer steps (after `warmup`)."""
    warmup: int = 3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"trainer.mode: {self.mode!r} is not one of {MODES}")
        if self.admission not in ("pace", "bound"):
            raise ValueError(f"trainer.admission: {self.admission!r} is not pace or bound")

    def rule(self) -> tuple[int, int, bool]:
        """(eta, publish_every, in_order), as `asyncrl.controller.mode_rule`."""
        if self.mode == "sync":
            return 0, 1, True
        if self.mode == "one_step_off":
            return 1, 1, True
        return self.eta, self.publish_every, False


@dataclass
class TraceEvent:
    """One call into the manager and the admission decisions right after it."""

    t: float
    op: str
    """finish | drop | took | step_done | set_version | start (the run's first admissions)."""
    args: tuple
    admitted: int
    can_start: bool
    limit: int


@dataclass
class SimResult:
    trained_tokens_per_s: float
    generated_tokens_per_s: float
    trainer_idle_ratio: float
    rollout_idle_ratio: float
    step_s: float
    staleness_hist: dict[int, int]
    staleness_mean: float
    staleness_max: int
    drops: int
    dropped_fraction: float
    trace: list[TraceEvent] = field(default_factory=list, repr=False)


def _now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a manager coroutine that never waits; raise if it would."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a StalenessManager call would wait inside the simulator")


class _SimPace(Pace):
    """The real `Pace`, told group latencies in simulated seconds (the manager passes wall seconds)."""

    sim_latency_s = 0.0

    def group_done(self, latency_s: float) -> None:
        super().group_done(self.sim_latency_s)


class Simulator:
    def __init__(self, costs: Costs, schedule: Schedule, seed: int = 0, record: bool = False) -> None:
        self.c, self.s, self.record = costs, schedule, record
        self.eta, self.k, in_order = schedule.rule()
        paced = schedule.mode == "fully_async" and schedule.admission == "pace"
        self.pace = _SimPace(batch_groups=costs.groups, eta=self.eta, slack=schedule.slack) if paced else None
        self.mgr = StalenessManager(batch_groups=costs.groups, eta=self.eta, in_order=in_order, pace=self.pace)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.frozen_since: float | None = None  # set while a publish pauses the servers: the rollout clock stops
        # Two clocks that run at a rate: the rollout's (sample ends are on it) and the trainer's
        # remaining work; `_advance` folds them up to `now`, `_set_rates` applies the contention.
        self.rc, self.rc_at, self.rrate = 0.0, 0.0, 1.0
        self.work_left, self.work_at, self.trate = 0.0, 0.0, 1.0
        self.generating = 0  # samples holding a server slot, all servers
        self.training = False  # the trainer is in a train step (not publishing, not waiting)
        self.weights_version = 0
        self.slots = costs.servers * costs.max_concurrency
        self.running_samples = 0
        self.inflight = [0] * costs.servers
        self.least: list[tuple[int, int]] = [(0, i) for i in range(costs.servers)]  # (in flight, server), lazy: stale entries skipped
        self.active = [0] * costs.servers
        self.waiting: list[deque] = [deque() for _ in range(costs.servers)]
        self.requests = [0] * costs.servers
        self.requests[0] = costs.requests_before  # the step-0 evaluation's request used up server 0's first draw
        # Per server: its running samples (end on its own clock, seq, group, tokens) and its clock's
        # anchor (own time at rollout time, rate); `heads` holds each server's next end on the rollout
        # clock (end, seq, stamp, server), an entry whose stamp is no longer the server's skipped.
        self.sheap: list[list[tuple[float, int, int, int]]] = [[] for _ in range(costs.servers)]
        self.anchor = [(0.0, 0.0, 1.0)] * costs.servers  # (own time, rollout time, own seconds per rollout second)
        self.stamp, self.heads = [0] * costs.servers, []
        self.seq = 0
        self.groups: dict[int, list] = {}  # gid -> [acquire version, samples left, tokens, min token version]
        self.starts: dict[int, deque[float]] = {}
        self.queue: list[tuple[int, int, int, int]] = []  # (version, arrival, gid, tokens)
        self.step = 0
        self.busy = False  # the trainer is training or publishing; `work_left` seconds of its own speed remain
        self.wait_since = 0.0
        self.batch: tuple[float, float, int] | None = None
        self.steps: list[tuple[float, float, int]] = []  # (start, end of training, tokens), as TimedEngine.steps
        self.completions: list[tuple[float, int]] = []
        self.hist: Counter[int] = Counter()
        self.trace: list[TraceEvent] = []

    # -- rollout side --------------------------------------------------------------------------
    def _rclock(self) -> float:
        return self.rc + (self.now - self.rc_at) * self.rrate

    def _advance(self, t: float) -> None:
        """Move both clocks to `t` at the rates set after the last event."""
        self.rc += (t - self.rc_at) * self.rrate
        self.rc_at = t
        if self.busy:
            self.work_left -= (t - self.work_at) * self.trate
            self.work_at = t
        self.now = t

    def _set_rates(self) -> None:
        """`Costs.contention`: while the trainer trains and a server generates, both run at 1/contention of their speed."""
        both = self.training and self.generating > 0 and self.frozen_since is None
        slow = 1.0 / self.c.contention if both else 1.0
        self.rrate = 0.0 if self.frozen_since is not None else slow
        self.trate = slow

    def _work(self, seconds: float) -> None:
        self.work_left, self.work_at, self.busy = seconds, self.now, True

    def _admit(self, op: str, args: tuple) -> None:
        n = 0
        while self.running_samples < self.slots and self.mgr.can_start():
            version = _now(self.mgr.acquire())
            self.starts.setdefault(version, deque()).append(self.now)
            gid = self.seq
            self.seq += 1
            self.groups[gid] = [version, self.c.group_size, 0, self.weights_version]
            for _ in range(self.c.group_size):
                self._submit(gid)
            n += 1
        if self.record:
            self.trace.append(TraceEvent(self.now, op, args, n, self.mgr.can_start(), self.mgr.admission_limit()))

    def _submit(self, gid: int) -> None:
        self.running_samples += 1
        srv = self._least_inflight()
        self.inflight[srv] += 1
        heapq.heappush(self.least, (self.inflight[srv], srv))
        self.waiting[srv].append((gid, self._draw(srv)))
        self._run_waiting(srv)

    def _least_inflight(self) -> int:
        """`min(range(servers), key=inflight)` (ties: the lowest index) in O(log servers): the heap
        holds an entry per change; one whose count is no longer the server's is skipped."""
        while True:
            n, srv = self.least[0]
            if self.inflight[srv] == n:
                return srv
            heapq.heappop(self.least)

    def _draw(self, srv: int) -> int:
        if self.c.length_seed is None:
            return self.c.lengths.draw(self.rng)
        self.requests[srv] += 1  # as CostModelServer._target: its seed, then its request count
        return self.c.lengths.draw(random.Random((self.c.length_seed + srv) * 1_000_003 + self.requests[srv]))

    def _run_waiting(self, srv: int) -> None:
        while self.waiting[srv] and self.active[srv] < self.c.max_concurrency:
            gid, n = self.waiting[srv].popleft()
            self.active[srv] += 1
            self.generating += 1
            g = self.groups[gid]
            g[2] += n
            g[3] = min(g[3], self.weights_version)
            end = self._own_clock(srv, self._rclock()) + n * self.c.token_cost_s + self.c.request_overhead_s
            self.seq += 1
            heapq.heappush(self.sheap[srv], (end, self.seq, gid, n))
        self._retime(srv)

    def _own_clock(self, srv: int, rc: float) -> float:
        return self.anchor[srv][0] + (rc - self.anchor[srv][1]) * self.anchor[srv][2]

    def _retime(self, srv: int) -> None:
        """After a start or an end on `srv`: its clock's rate for its new active count (the anchor
        folded at the old rate first; untouched without a slope), and its next end on the rollout clock."""
        if self.c.token_cost_slope_s:
            rc = self._rclock()
            self.anchor[srv] = (self._own_clock(srv, rc), rc, self.c.token_cost_s / self.c.token_cost_at(self.active[srv]))
        self.stamp[srv] += 1
        if self.sheap[srv]:
            (end, seq, _, _), (own, at, rate) = self.sheap[srv][0], self.anchor[srv]
            heapq.heappush(self.heads, (at + (end - own) / rate, seq, self.stamp[srv], srv))

    def _next_end(self) -> tuple[float, int, int, int] | None:
        while self.heads and self.heads[0][2] != self.stamp[self.heads[0][3]]:
            heapq.heappop(self.heads)
        return self.heads[0] if self.heads else None

    def _sample_done(self, srv: int, gid: int, n: int) -> None:
        self.active[srv] -= 1
        self.generating -= 1
        self.inflight[srv] -= 1
        heapq.heappush(self.least, (self.inflight[srv], srv))
        self.running_samples -= 1
        self.completions.append((self.now, n))
        self._run_waiting(srv)
        g = self.groups[gid]
        g[1] -= 1
        if g[1]:
            self._admit("sample", ())
            return
        del self.groups[gid]
        self.queue.append((g[3], gid, gid, g[2]))
        if self.pace is not None:
            self.pace.sim_latency_s = self.now - self.starts[g[0]].popleft()
        else:
            self.starts[g[0]].popleft()
        _now(self.mgr.finish(True, version=g[0]))
        self._admit("finish", (g[0],))
        self._try_train()

    # -- trainer side --------------------------------------------------------------------------
    def _try_train(self) -> None:
        if self.busy or self.step >= self.s.warmup + self.s.steps:
            return
        newest = self.mgr.takeable_version()
        picked, dropped = [], []
        for item in sorted(self.queue):
            version = item[0]
            if newest is not None and version > newest:
                break
            if staleness(version, self.step) > self.eta:
                dropped.append(item)
                continue
            picked.append(item)
            if len(picked) == self.c.groups:
                break
        for item in dropped:
            self.queue.remove(item)
        if dropped:
            _now(self.mgr.drop_accepted("stale", len(dropped)))
            self._admit("drop", (len(dropped),))
        if len(picked) < self.c.groups:
            return
        for item in picked:
            self.queue.remove(item)
        _now(self.mgr.took(len(picked)))
        self._admit("took", (len(picked),))
        self.hist.update(self.step - item[0] for item in picked for _ in range(self.c.group_size))
        tokens = sum(item[3] for item in picked)
        self.batch = (self.now - self.wait_since, self.now, tokens)
        self._work(tokens / self.c.trainer_tokens_per_s + self.c.step_overhead_s)
        self.publishing, self.training = False, True

    def _trainer_event(self) -> None:
        wait_s, t_batch, tokens = self.batch
        if not self.publishing:
            self.steps.append((t_batch, self.now, tokens))
            self.step += 1
            last = self.step == self.s.warmup + self.s.steps
            if self.step % self.k == 0 or last:
                self.publishing, self.training = True, False
                self.frozen_since = self.now
                self.weights_version = self.step
                self._work(self.c.publish_s)
                return
        else:
            self.frozen_since = None
            _now(self.mgr.set_version(self.step))
            self._admit("set_version", (self.step,))
        _now(self.mgr.step_done(self.now - t_batch, wait_s))
        self._admit("step_done", (round(self.now - t_batch, 9), round(wait_s, 9)))
        self.busy, self.training, self.wait_since = False, False, self.now
        self._try_train()

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        total = self.s.warmup + self.s.steps
        self._admit("start", ())
        while self.step < total:
            head = self._next_end()
            t_roll = self.rc_at + (head[0] - self.rc) / self.rrate if head is not None and self.rrate > 0 else float("inf")
            t_train = self.work_at + self.work_left / self.trate if self.busy else float("inf")
            if t_roll == t_train == float("inf"):
                raise RuntimeError(f"simulation stalled at step {self.step} (mode {self.s.mode}, {len(self.queue)} groups queued)")
            if t_train <= t_roll:
                self._advance(t_train)
                self._trainer_event()
            else:
                srv = heapq.heappop(self.heads)[3]
                _, _, gid, n = heapq.heappop(self.sheap[srv])
                self._advance(t_roll)
                self._sample_done(srv, gid, n)
            self._set_rates()
        return self._measure()

    def _measure(self) -> SimResult:
        w = self.s.warmup
        t0, t1 = (self.steps[w - 1][1] if w else self.steps[0][0]), self.steps[-1][1]
        window = self.steps[w:]
        span = t1 - t0
        tokens = sum(s[2] for s in window)
        busy = sum(s[1] - s[0] for s in window)
        generated = sum(k for t, k in self.completions if t0 < t <= t1)
        n = sum(self.hist.values())
        drops = sum(self.mgr.dropped.values())
        return SimResult(
            trained_tokens_per_s=tokens / span, generated_tokens_per_s=generated / span,
            trainer_idle_ratio=1 - busy / span, rollout_idle_ratio=1 - generated / (self.c.rollout_capacity * span),
            step_s=span / len(window), staleness_hist=dict(sorted(self.hist.items())),
            staleness_mean=sum(k * v for k, v in self.hist.items()) / n, staleness_max=max(self.hist),
            drops=drops, dropped_fraction=drops / (drops + len(self.steps) * self.c.groups), trace=self.trace)


def simulate(costs: Costs, schedule: Schedule, seeds: int = 3, seed: int = 0, max_groups: int | None = None) -> dict[str, Any]:
    """The mean of `seeds` simulated runs (their spread is the long tail's), as a JSON-able row.
    `max_groups`: simulate a slice of at most that many groups per step (`Costs.slice_factor`) and
    scale its tokens/s and drops back to the whole run (`slice` in the row says by how much)."""
    f = 1 if max_groups is None else costs.slice_factor(max_groups)
    part = costs.sliced(f)
    runs = [Simulator(part, schedule, seed=seed + i).run() for i in range(seeds)]
    mean = lambda key: sum(getattr(r, key) for r in runs) / len(runs)
    hist: Counter[int] = Counter()
    for r in runs:
        hist.update(r.staleness_hist)
    return {
        "mode": schedule.mode,
        "trained_tokens_per_s": round(f * mean("trained_tokens_per_s"), 1),
        "ratio_to_bound": round(mean("trained_tokens_per_s") / part.bound, 3),
        "generated_tokens_per_s": round(f * mean("generated_tokens_per_s"), 1),
        "trainer_idle_ratio": round(mean("trainer_idle_ratio"), 3),
        "rollout_idle_ratio": round(mean("rollout_idle_ratio"), 3),
        "step_s": round(mean("step_s"), 4),
        "staleness_hist": {int(k): v for k, v in sorted(hist.items())},
        "staleness_mean": round(mean("staleness_mean"), 3),
        "staleness_max": max(r.staleness_max for r in runs),
        "drops": round(f * mean("drops"), 2),
        "dropped_fraction": round(mean("dropped_fraction"), 3),
        "slice": f,
    }
