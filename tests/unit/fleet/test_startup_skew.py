"""`startup_split` of a server on a host whose clock is off: the actor's times are moved onto the
controller's clock by the offset its reply shows (`reply_at`), so the split reads as on one clock."""

from __future__ import annotations

import pytest

from asyncrl.rollout.remote_server import startup_split

HOUR = 3600.0


def _actor_times(offset: float) -> dict[str, float]:
    """A start as the actor's clock (`offset` s from this one) records it: the process at 1001, the actor
    body at 1004.5, the engine built at 1006 and the `start` reply sent 1 ms later (this clock's seconds)."""
    return {"process_at": 1001.0 + offset, "init_at": 1004.5 + offset, "built_at": 1006.0 + offset,
            "reply_at": 1006.001 + offset}


def _parts_add_up(split: dict[str, float]) -> None:
    assert set(split) == {"queued_s", "imports_s", "build_s", "total_s"}
    assert all(v >= 0 for v in split.values()), split
    assert split["queued_s"] + split["imports_s"] + split["build_s"] == pytest.approx(split["total_s"], abs=0.005)


@pytest.mark.parametrize("offset", [HOUR, -HOUR, 0.0])
def test_an_actor_whose_clock_is_off_splits_as_on_this_clock(offset):
    split = startup_split(1000.0, _actor_times(offset), 1006.001)  # the reply arrives at once
    assert split == {"queued_s": 1.0, "imports_s": 3.5, "build_s": 1.5, "total_s": 6.001}
    _parts_add_up(split)


def test_the_replys_travel_is_taken_for_skew_and_the_parts_still_add_up():
    split = startup_split(1000.0, _actor_times(HOUR), 1006.05)  # 49 ms on the way: the times move by that much
    assert split == {"queued_s": 1.049, "imports_s": 3.5, "build_s": 1.5, "total_s": 6.05}
    _parts_add_up(split)


def test_without_reply_at_an_hour_of_skew_lands_in_one_part():
    """What `reply_at` is for: the same times without it put the hour into the queue."""
    times = _actor_times(HOUR)
    del times["reply_at"]
    split = startup_split(1000.0, times, 1006.001)
    assert split["queued_s"] > HOUR - 1
