"""A replacement server's Ray name: waited for while the dead actor holds it, a failed start after that.

Seen in `asyncrl bench chaos` beside a test suite: a replacement died while starting, and its name stayed
taken past the wait; the `ActorAlreadyExistsError` (a `ValueError`) escaped the fleet's restart loop and
stopped the run. It is now a `ServerDied`, which the restart loop counts as one failed attempt.
"""

import asyncio

import pytest

from asyncrl.rollout.fleet_build import _named_spawn
from asyncrl.rollout.router import ServerDied


def test_a_name_freed_after_a_while_is_taken_when_free() -> None:
    calls = []

    def spawn() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ValueError("The name run/server-main-1 (namespace=asyncrl) is already taken.")
        return "server"

    assert asyncio.run(_named_spawn(spawn, "main-1", timeout_s=5.0)) == "server"
    assert len(calls) == 3


def test_a_name_held_past_the_wait_is_a_failed_start_not_a_stop() -> None:
    def spawn() -> str:
        raise ValueError("The name run/server-main-1 (namespace=asyncrl) is already taken.")

    with pytest.raises(ServerDied, match="main-1: Ray still holds its actor name"):
        asyncio.run(_named_spawn(spawn, "main-1", timeout_s=0.3))


def test_another_value_error_is_not_hidden() -> None:
    def spawn() -> str:
        raise ValueError("bad resource spec")

    with pytest.raises(ValueError, match="bad resource spec"):
        asyncio.run(_named_spawn(spawn, "main-1", timeout_s=5.0))
