"""How a reward function is run: user code behind three guards.

- `RewardPool`: plain (sync) reward functions run in a bounded pool of threads of their own,
  one per process (never the event loop's default executor). A call's timeout counts from when a
  worker starts it; a worker stuck past it is abandoned and replaced, so hung calls never starve
  healthy ones. Coroutine rewards are awaited and cancelled at the timeout.
- `score`: an exception, a timeout or a return value that is not a finite real number (or a
  `(number, dict)` tuple) becomes a counted failure: reward 0, `reward_info["failed"]` = the cause.
  `bool` counts as a number (True is 1.0): `return pred == answer` is a common, honest reward.
- `Scorer`: `max_failures` failures in a row (any cause) raise `RewardBroken`, which stops the run
  (it is never turned into a failed reward); any success resets the count.
Boundary: no agents, no model calls; nothing here knows what the reward measures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import inspect
import math
import numbers
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from agents.tools.base import ToolUnavailable

# ---- errors -------------------------------------------------------------------------------


class RewardBroken(RuntimeError):
    """A reward function that keeps failing: the run must stop (not one more failed sample).

    Raised by `Scorer` after `agent.max_reward_failures` failures in a row, or when its calls
    hang faster than the pool can replace the threads they hold.
    """

    def __init__(self, reward: str, count: int, cause: str, limit: int | None = None) -> None:
        self.reward, self.count, self.cause, self.limit = reward, count, cause, limit
        if limit is not None:
            msg = (f"reward {reward} failed {count} times in a row (agent.max_reward_failures={limit}); "
                   f"last cause: {cause}")
        else:
            msg = f"reward {reward} is broken after {count} failures in a row (agent.max_reward_failures): {cause}"
        super().__init__(msg)

    def __reduce__(self) -> Any:  # crosses Ray actors intact
        return type(self), (self.reward, self.count, self.cause, self.limit)


class PoolExhausted(RuntimeError):
    """Too many timed-out reward calls still hold their threads: the pool takes no more calls."""


# ---- the pool -----------------------------------------------------------------------------


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: cf.Future = field(default_factory=cf.Future)
    """The call's outcome; cancelled before it starts, it never runs."""
    started: cf.Future = field(default_factory=cf.Future)
    """Set when a worker starts the call: its timeout counts from here."""
    worker: "_Worker | None" = None


@dataclass
class _Worker:
    abandoned: bool = False


class RewardPool:
    """`workers` daemon threads running plain reward functions, apart from the loop's default executor.

    Trace (workers=2, timeout 2 s): calls a (hangs), b, c queued -> w1 starts a, w2 runs b then c;
    at 2 s after a started, a times out: w1 is abandoned (left to finish or hang on its own) and w3
    takes its place; b and c got their rewards. At most `max_abandoned` abandoned threads may be alive;
    one more and the pool is exhausted: it refuses calls (`PoolExhausted`) until some of them return.
    """

    def __init__(self, workers: int = 4, max_abandoned: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"agent.reward_workers must be >= 1, got {workers}")
        self.workers = workers
        self.max_abandoned = 4 * workers if max_abandoned is None else max_abandoned
        self.abandoned = 0
        """Abandoned threads still running their timed-out call."""
        self._live = 0
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        with self._lock:
            self._spawn_missing()

    @property
    def exhausted(self) -> bool:
        return self.abandoned > self.max_abandoned

    def grow(self, workers: int) -> None:
        with self._lock:
            if workers > self.workers:
                self.workers, self.max_abandoned = workers, max(self.max_abandoned, 4 * workers)
                self._spawn_missing()

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        """`fn(*args)` on a worker; `asyncio.TimeoutError` once it ran `timeout_s` (its worker is replaced),
        `PoolExhausted` when that leaves more than `max_abandoned` threads stuck."""
        if self.exhausted:
            raise PoolExhausted(self._why())
        job = _Job(fn, args)
        self._jobs.put(job)
        try:
            await asyncio.wrap_future(job.started)
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                return await asyncio.wrap_future(job.future)
        except asyncio.TimeoutError:
            job.future.cancel()
            if self._abandon(job):
                raise PoolExhausted(self._why()) from None
            raise
        except asyncio.CancelledError:
            if not job.future.cancel():  # already running: its thread is lost to us
                self._abandon(job)
            raise

    def _why(self) -> str:
        return (f"reward pool exhausted: {self.abandoned} timed-out calls still hold their threads "
                f"(cap {self.max_abandoned} = 4 x agent.reward_workers)")

    def _abandon(self, job: _Job) -> bool:
        """Give up on the thread running `job` and replace it; True when that exhausts the pool."""
        with self._lock:
            w = job.worker
            if w is None or w.abandoned or job.future.done():
                return False
            w.abandoned, self._live, self.abandoned = True, self._live - 1, self.abandoned + 1
            self._spawn_missing()
            if not self.exhausted:
                return False
        while True:  # queued calls would wait forever for workers that never come: fail them now
            try:
                queued = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if queued.future.set_running_or_notify_cancel():
                queued.future.set_exception(PoolExhausted(self._why()))
            _set(queued.started)

    def _spawn_missing(self) -> None:  # holding the lock
        while self._live < self.workers and not self.exhausted:
            self._live += 1
            threading.Thread(target=self._work, args=(_Worker(),), name="reward-worker", daemon=True).start()

    def _work(self, w: _Worker) -> None:
        while True:
            job = self._jobs.get()
            job.worker = w  # before it runs: a waiter that cannot cancel it finds whom to abandon
            if not job.future.set_running_or_notify_cancel():
                continue
            _set(job.started)
            try:
                job.future.set_result(job.fn(*job.args))
            except Exception as e:
                job.future.set_exception(e)
            except BaseException as e:  # SystemExit and the like from user code: a failure, not our thread's end
                job.future.set_exception(RuntimeError(f"reward raised {type(e).__name__}: {e}"))
            with self._lock:
                if w.abandoned:
                    self.abandoned -= 1
                    self._spawn_missing()
                    return


def _set(f: cf.Future) -> None:
    try:
        f.set_result(None)
    except cf.InvalidStateError:  # its waiter was cancelled
        pass


_POOLS: dict[int, RewardPool] = {}
_POOLS_LOCK = threading.Lock()


def reward_pool(workers: int = 4) -> RewardPool:
    """This process's reward pool (grown to `workers` threads if it has fewer); one per pid, so a forked child builds its own."""
    with _POOLS_LOCK:
        pool = _POOLS.get(os.getpid())
        if pool is None:
            pool = _POOLS[os.getpid()] = RewardPool(workers)
        else:
            pool.grow(workers)
        return pool


# ---- one call -----------------------------------------------------------------------------


class _BadReturn(ValueError):
    pass


async def score(
    fn: Callable[..., Any], response: str, answer: str, timeout_s: float, pool: RewardPool | None = None
) -> tuple[float, dict[str, Any]]:
    """Run a reward function with a timeout; failures give (0.0, {"failed": cause}), never an exception."""
    reward, info, _ = await _score(fn, response, answer, timeout_s, pool)
    return reward, info


async def _score(
    fn: Callable[..., Any], response: str, answer: str, timeout_s: float, pool: RewardPool | None
) -> tuple[float, dict[str, Any], bool]:
    """(reward, info, pool exhausted)."""
    try:
        if _is_async(fn):
            async with asyncio.timeout(timeout_s):
                out = await fn(response, answer)
        else:
            out = await (pool or reward_pool()).run(fn, (response, answer), timeout_s)
        return *_as_reward(out), False
    except asyncio.TimeoutError:
        return 0.0, {"failed": "timeout"}, False
    except _BadReturn as e:
        return 0.0, {"failed": str(e)}, False
    except PoolExhausted as e:
        return 0.0, {"failed": str(e)}, True
    except (RewardBroken, ToolUnavailable):  # the run's own fault (e.g. a host that cannot isolate code): stop
        raise
    except Exception as e:  # a user's reward function: translate any error into a counted failure
        return 0.0, {"failed": f"{type(e).__name__}: {e}"[:200]}, False


def _as_reward(out: Any) -> tuple[float, dict[str, Any]]:
    """A finite float and an encodable info dict from what a reward returned, or `_BadReturn(cause)`."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise _BadReturn(f"bad return: a tuple must be (number, dict), got {_show(out)}")
        value, info = out
    else:
        value, info = out, {}
    if not isinstance(value, numbers.Real):  # rejects str (even "0.5"), None, Decimal, arrays
        raise _BadReturn(f"bad return: {type(value).__name__} {_show(value)}; want a number or (number, dict)")
    try:
        v = float(value)
    except (OverflowError, ValueError, TypeError) as e:
        raise _BadReturn(f"bad return: {_show(value)} is not a float ({e})") from None
    if not math.isfinite(v):
        raise _BadReturn(f"not finite: {v}")
    if not all(isinstance(k, str) for k in info):
        raise _BadReturn(f"bad return: info keys must be str, got {_show(list(info))}")
    try:
        msgspec.msgpack.encode(info)
    except (TypeError, ValueError, OverflowError) as e:
        raise _BadReturn(f"bad return: info does not encode ({e})") from None
    return v, dict(info)


def _show(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


def _is_async(fn: Callable[..., Any]) -> bool:
    """Coroutine functions, partials of them, and objects with an `async __call__`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def reward_name(fn: Callable[..., Any]) -> str:
    """`module:qualname` of a reward function (through partials), for error messages."""
    f: Any = fn
    while isinstance(f, functools.partial):
        f = f.func
    qual = getattr(f, "__qualname__", None) or type(f).__qualname__
    mod = getattr(f, "__module__", None) or type(f).__module__
    return f"{mod}:{qual}"


# ---- the streak ---------------------------------------------------------------------------


class Scorer:
    """A reward function bound to its limits: `await scorer(response, answer) -> (reward, info)`.

    Failures are counted by `score`; `max_failures` of them in a row raise `RewardBroken`
    (trace, max_failures=3: fail, fail, ok, fail, fail, fail -> raises on the sixth call).
    An exhausted pool (calls hang faster than their threads can be replaced) raises at once.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, timeout_s: float = 10.0,
                 max_failures: int = 100, workers: int = 4, pool: RewardPool | None = None) -> None:
        if max_failures < 1:
            raise ValueError(f"agent.max_reward_failures must be >= 1, got {max_failures}")
        self.fn, self.timeout_s, self.max_failures = fn, timeout_s, max_failures
        self.name = name or reward_name(fn)
        self._pool, self._workers = pool, workers
        self.failures_in_a_row = 0
        self._lock = threading.Lock()

    @property
    def pool(self) -> RewardPool:
        if self._pool is None:  # built lazily, in the process that scores
            self._pool = reward_pool(self._workers)
        return self._pool

    async def __call__(self, response: str, answer: str) -> tuple[float, dict[str, Any]]:
        pool = None if _is_async(self.fn) else self.pool
        reward, info, exhausted = await _score(self.fn, response, answer, self.timeout_s, pool)
        with self._lock:
            if "failed" not in info:
                self.failures_in_a_row = 0
                return reward, info
            self.failures_in_a_row += 1
            n = self.failures_in_a_row
        if exhausted:
            raise RewardBroken(self.name, n, info["failed"])
        if n >= self.max_failures:
            raise RewardBroken(self.name, n, info["failed"], self.max_failures)
        return reward, info
