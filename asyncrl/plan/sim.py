"""A discrete-event simulator of the pipeline, whose admission is the real `StalenessManager`.

Job: replay what `asyncrl.controller.Pipeline` does on a `Costs` load, in simulated seconds, fast
(a 1,024-GPU step in milliseconds). The parts and the rules they follow:

- rollouter: starts a group while fewer samples run than the fleet's slots
  (`rollout.max_running_samples` = servers x max_concurrency) *and* `StalenessManager.can_start()`;
  then `acquire()` (the real one). A sample goes to the server with the fewest requests in flight
  (with `Schedule.group_affinity`, as `rollout.group_affinity`: the group's first sample does, and
  the rest of the group follows it to that server) and, once it holds one of that server's slots,
  generates a token every `Costs.token_cost_at(a)` seconds while `a` samples run there: each server
  has its own clock, which runs at `token_cost_s / token_cost_at(a)` of the rollout clock and is
  re-timed at every start and end on it (`token_cost_slope_s` 0: every server's clock is the rollout
  clock, as before).
- partial rollouts (`Schedule.update_mode`, as `rollout.update_mode`): a publish pauses every
  server. `keep`: samples in flight continue under the new weights when it ends; `abort` (with
  `rollout.partial_rollouts`): they are resubmitted with their tokens so far, and each server
  first prefills them again (its clock stops for `Costs.prefill_token_cost_s` x the prompt and
  response tokens it holds: a weight update drops the KV cache); `wait`: the publish waits until
  every sample in flight has finished, no new one starting meanwhile. Either way a sample's tokens
  carry the version that generated them (`versions.version_runs`).
- queue: a finished group is queued under its oldest token's version (`trainer.staleness_level`
  group) or its newest one's (token); the trainer takes B groups oldest first, none newer than
  `takeable_version()` in order, dropping (counted, through `drop_accepted`) the ones whose
  staleness at its step would exceed eta, as the memory metadata store's `_take` does; at token
  level the tokens older than eta are counted as masked (they stay in the input and cost the same).
- trainer: `took(B)`, trains `tokens / trainer_tokens_per_s + step_overhead_s`, publishes every k
  steps (`publish_s`, every server paused: its clock frozen), then `set_version` and
  `step_done(busy, wait)`, in `_train_loop`'s order.
- contention (`Costs.contention`, 1 = none): while the trainer trains and any server generates,
  both run at 1/contention of their speed (rollout and trainer sharing a host's CPUs, as the
  embedded demo does; separate GPUs share nothing and keep 1).

The manager is driven synchronously: none of its calls made here ever waits (the simulator only
calls `acquire` when `can_start()` holds), so each coroutine runs to its end in one `send`. It is
built by `StalenessManager.for_rule` from `Schedule.rule`, as the controller builds its own from
`TrainerConfig.rule`, on the simulated clock (what the pace's latencies are measured on); idle
ratios are measured here. What it does not model: a new request's own
prefill, KV-cache limits, event-loop lag of a loaded host; with a slope, `request_overhead_s` is
stretched like the tokens.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from typing import Any, Coroutine

from asyncrl.plan.costs import Costs
from asyncrl.plan.schedule import MODES, STALENESS_LEVELS, UPDATE_MODES, Schedule, SimResult, TraceEvent
from asyncrl.plan.versions import GroupVersions, version_runs
from asyncrl.staleness import StalenessManager
from transfer_queue.rules import staleness

__all__ = ["MODES", "STALENESS_LEVELS", "UPDATE_MODES", "Schedule", "SimResult", "Simulator", "TraceEvent", "simulate"]

def _now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a manager coroutine that never waits; raise if it would."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a StalenessManager call would wait inside the simulator")


class Simulator:
    def __init__(self, costs: Costs, schedule: Schedule, seed: int = 0, record: bool = False) -> None:
        self.c, self.s, self.record = costs, schedule, record
        rule = schedule.rule
        self.eta, self.k = rule.eta, rule.publish_every
        self.now = 0.0
        self.mgr = StalenessManager.for_rule(rule, batch_groups=costs.groups, clock=lambda: self.now)
        self.rng = random.Random(seed)
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
        self.group_server: dict[int, int] = {}  # `group_affinity`: a running group's server
        self.requests = [0] * costs.servers
        self.requests[0] = costs.requests_before  # the step-0 evaluation's request used up server 0's first draw
        # Per server: its running samples (end on its own clock, seq, group, tokens) and its clock's
        # anchor (own time at rollout time, rate); `heads` holds each server's next end on the rollout
        # clock (end, seq, stamp, server), an entry whose stamp is no longer the server's skipped.
        self.sheap: list[list[tuple[float, int, int, int]]] = [[] for _ in range(costs.servers)]
        # (own time, rollout time, own seconds per rollout second): own time stands still before the
        # rollout time (an `abort` publish's prefill stalls the server until then)
        self.anchor = [(0.0, 0.0, 1.0)] * costs.servers
        self.stamp, self.heads = [0] * costs.servers, []
        self.seq = 0
        self.groups: dict[int, list] = {}  # gid -> [acquire version, samples left, tokens, GroupVersions]
        self.started: dict[int, tuple[float, int]] = {}  # running sample seq -> (start on its server's clock, first version)
        self.publishes: list[list[tuple[float, int]]] = [[] for _ in range(costs.servers)]  # per server: (own time, new version)
        self.draining = False  # update_mode wait: a publish waits for the samples in flight; none starts
        self.versions: dict[int, GroupVersions] = {}  # queued gid -> its tokens' versions
        self.ages = [0.0, 0.0, 0.0]  # trained tokens, of them older than eta, sum of token ages
        self.samples_trained = self.partial = self.max_span = 0
        self.prefill_stall = [0.0, 0]  # seconds servers stood still prefilling again, server-publishes
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
            gid = self.seq
            self.seq += 1
            self.groups[gid] = [version, self.c.group_size, 0, GroupVersions()]
            for _ in range(self.c.group_size):
                self._submit(gid)
            n += 1
        if self.record:
            self.trace.append(TraceEvent(self.now, op, args, n, self.mgr.can_start(), self.mgr.admission_limit()))

    def _submit(self, gid: int) -> None:
        self.running_samples += 1
        srv = self.group_server.get(gid)
        if srv is None:
            srv = self._least_inflight()
            if self.s.group_affinity:
                self.group_server[gid] = srv
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
        while self.waiting[srv] and self.active[srv] < self.c.max_concurrency and not self.draining:
            gid, n = self.waiting[srv].popleft()
            self.active[srv] += 1
            self.generating += 1
            self.groups[gid][2] += n
            start = self._own_clock(srv, self._rclock())
            end = start + n * self.c.token_cost_s + self.c.request_overhead_s
            self.seq += 1
            self.started[self.seq] = (start, self.weights_version)
            heapq.heappush(self.sheap[srv], (end, self.seq, gid, n))
        self._retime(srv)

    def _own_clock(self, srv: int, rc: float) -> float:
        own, at, rate = self.anchor[srv]
        return own + max(0.0, rc - at) * rate

    def _retime(self, srv: int) -> None:
        """After a start or an end on `srv`: its clock's rate for its new active count (the anchor
        folded at the old rate first, a stall kept; untouched without a slope), and its next end on the rollout clock."""
        if self.c.token_cost_slope_s:
            rc = self._rclock()
            at = max(rc, self.anchor[srv][1])
            self.anchor[srv] = (self._own_clock(srv, rc), at, self.c.token_cost_s / self.c.token_cost_at(self.active[srv]))
        self.stamp[srv] += 1
        if self.sheap[srv]:
            (end, seq, _, _), (own, at, rate) = self.sheap[srv][0], self.anchor[srv]
            heapq.heappush(self.heads, (at + (end - own) / rate, seq, self.stamp[srv], srv))

    def _next_end(self) -> tuple[float, int, int, int] | None:
        while self.heads and self.heads[0][2] != self.stamp[self.heads[0][3]]:
            heapq.heappop(self.heads)
        return self.heads[0] if self.heads else None

    def _sample_done(self, srv: int, seq: int, gid: int, n: int) -> None:
        self.active[srv] -= 1
        self.generating -= 1
        self.inflight[srv] -= 1
        heapq.heappush(self.least, (self.inflight[srv], srv))
        self.running_samples -= 1
        self.completions.append((self.now, n))
        start, first = self.started.pop(seq)
        g = self.groups[gid]
        g[3].add(version_runs(start, n, self.c.token_cost_s, first, self.publishes[srv]))
        if self.draining and not self.generating:
            self._publish()
        self._run_waiting(srv)
        g[1] -= 1
        if g[1]:
            self._admit("sample", ())
            return
        del self.groups[gid]
        self.group_server.pop(gid, None)
        self.versions[gid] = g[3]
        self.queue.append((g[3].queue_version(self.s.staleness_level), gid, gid, g[2]))
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
            del self.versions[item[2]]
        if dropped:
            _now(self.mgr.drop_accepted("stale", len(dropped)))
            self._admit("drop", (len(dropped),))
        if len(picked) < self.c.groups:
            return
        for item in picked:
            self.queue.remove(item)
        _now(self.mgr.took(len(picked)))
        self._admit("took", (len(picked),))
        for item in picked:
            v = self.versions.pop(item[2])
            self.hist[self.step - v.oldest] += self.c.group_size
            self.ages = [a + b for a, b in zip(self.ages, v.ages(self.step, self.eta))]
            self.samples_trained += self.c.group_size
            self.partial += v.partial
            self.max_span = max(self.max_span, v.max_span)
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
                if self.s.update_mode == "wait" and self.generating:
                    self.draining = True  # the weights load once the last sample in flight ends
                    self._work(float("inf"))
                    return
                self._publish()
                return
        else:
            self.frozen_since = None
            if self.s.update_mode == "abort":
                self._prefill_again()
            _now(self.mgr.set_version(self.step))
            self._admit("set_version", (self.step,))
            if self.s.update_mode == "wait":
                for srv in range(self.c.servers):
                    self._run_waiting(srv)  # held back while the servers drained
        _now(self.mgr.step_done(self.now - t_batch, wait_s))
        self._admit("step_done", (round(self.now - t_batch, 9), round(wait_s, 9)))
        self.busy, self.training, self.wait_since = False, False, self.now
        self._try_train()

    def _publish(self) -> None:
        """Pause every server (their clocks freeze) and load the new weights: `publish_s` of trainer work."""
        self.draining = False
        self.frozen_since = self.now
        self.weights_version = self.step
        rc = self._rclock()
        for srv in range(self.c.servers):
            self.publishes[srv].append((self._own_clock(srv, rc), self.step))
        self._work(self.c.publish_s)

    def _prefill_again(self) -> None:
        """`abort`: every server prefills the prompts and tokens so far of the samples it was running
        before it generates again (the update dropped their KV cache): its clock stands still that long."""
        if not self.c.prefill_token_cost_s:
            return
        rc = self._rclock()
        self.prefill_stall[1] += self.c.servers
        for srv in range(self.c.servers):
            if not self.sheap[srv]:
                continue
            own = self._own_clock(srv, rc)
            context = 0.0
            for _, seq, _, n in self.sheap[srv]:
                start = self.started[seq][0]
                context += self.c.prompt_tokens + min(float(n), max(0.0, (own - start) / self.c.token_cost_s))
            at = max(rc, self.anchor[srv][1]) + context * self.c.prefill_token_cost_s
            self.prefill_stall[0] += context * self.c.prefill_token_cost_s
            self.anchor[srv] = (own, at, self.anchor[srv][2])
            self._retime(srv)

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
                _, seq, gid, n = heapq.heappop(self.sheap[srv])
                self._advance(t_roll)
                self._sample_done(srv, seq, gid, n)
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
            drops=drops, dropped_fraction=drops / (drops + len(self.steps) * self.c.groups),
            stale_token_fraction=self.ages[1] / max(self.ages[0], 1.0), token_staleness_mean=self.ages[2] / max(self.ages[0], 1.0),
            partial_fraction=self.partial / max(self.samples_trained, 1), max_partial_span=self.max_span,
            prefill_s=self.prefill_stall[0] / max(self.prefill_stall[1], 1), trace=self.trace)


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
        "version_s": round(mean("step_s") * schedule.rule.publish_every, 4),
        "staleness_hist": {int(k): v for k, v in sorted(hist.items())},
        "staleness_mean": round(mean("staleness_mean"), 3),
        "staleness_max": max(r.staleness_max for r in runs),
        "drops": round(f * mean("drops"), 2),
        "dropped_fraction": round(mean("dropped_fraction"), 3),
        "stale_token_fraction": round(mean("stale_token_fraction"), 3),
        "token_staleness_mean": round(mean("token_staleness_mean"), 3),
        "partial_fraction": round(mean("partial_fraction"), 3),
        "max_partial_span": max(r.max_partial_span for r in runs),
        "prefill_s": round(mean("prefill_s"), 3),
        "slice": f,
    }
