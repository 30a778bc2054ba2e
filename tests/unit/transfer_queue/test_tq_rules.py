"""The queue's pure rules (`transfer_queue.rules`): the staleness formula, the group selection of `get`,
and the stale drops a memory `get` returns in its `Batch`."""

from __future__ import annotations

import pytest

from transfer_queue.metadata.base import GetRequest
from transfer_queue.metadata.memory import MemoryController
from transfer_queue.records import SampleMeta
from transfer_queue.rules import Candidate, select_groups, staleness


def test_staleness_is_version_at_use_minus_oldest_version():
    assert staleness(3, 5) == 2 and staleness(5, 5) == 0 and staleness(7, 5) == -2


@pytest.mark.timeout(5)
def test_selection_follows_its_docstring_trace():
    cands = [Candidate("a", 3, 2), Candidate("b", 5, 2), Candidate("c", 4, 2, ready=False),
             Candidate("d", 4, 2), Candidate("e", 6, 2)]
    sel = select_groups(cands, num_groups=2, max_staleness=1, current_version=5, max_version=5)
    assert (sel.take, sel.stale, sel.enough) == (["d", "b"], ["a"], True)


@pytest.mark.timeout(5)
def test_oldest_first_ties_in_offer_order_and_max_version_stops_the_walk():
    cands = [Candidate("young", 5, 1), Candidate("old-a", 3, 1), Candidate("old-b", 3, 1), Candidate("new", 9, 1)]
    assert select_groups(cands, num_groups=3).take == ["old-a", "old-b", "young"]
    sel = select_groups(cands, num_groups=4, max_version=5)
    assert sel.take == ["old-a", "old-b", "young"] and not sel.enough
    # max_version ends the walk before the staleness check: a group newer than it is kept, never dropped
    sel = select_groups([Candidate("x", 1, 1), Candidate("y", 4, 1)], num_groups=2, max_staleness=0,
                        current_version=9, max_version=2)
    assert sel.stale == ["x"] and sel.take == [] and not sel.enough


@pytest.mark.timeout(5)
def test_other_sizes_and_unready_groups_are_passed_over_not_dropped():
    cands = [Candidate("pair", 0, 2, group_size=2), Candidate("unready", 1, 4, group_size=4, ready=False),
             Candidate("four", 1, 4, group_size=4)]
    sel = select_groups(cands, num_groups=2, group_size=4, max_staleness=1, current_version=2)
    # "pair" would be stale but is not this get's size: left for a get of its size
    assert (sel.take, sel.stale, sel.enough) == (["four"], [], False)
    # a group too stale is dropped whether or not its fields are all there: it will never be younger
    sel = select_groups(cands, num_groups=2, group_size=4, max_staleness=0, current_version=2)
    assert sel.stale == ["unready", "four"] and sel.take == []


@pytest.mark.timeout(5)
def test_num_samples_and_what_the_caller_holds_count_toward_enough():
    cands = [Candidate(k, 0, 3) for k in "abc"]
    assert select_groups(cands, num_samples=4).take == ["a", "b"]  # whole groups until at least 4 records
    assert select_groups(cands, num_samples=4, held_records=2).take == ["a"]
    sel = select_groups(cands, num_groups=2, held_groups=2)
    assert sel.take == [] and sel.enough
    with pytest.raises(ValueError, match="num_groups or num_samples"):
        select_groups(cands, num_groups=1, num_samples=1)
    with pytest.raises(ValueError, match="needs current_version"):
        select_groups(cands, num_groups=1, max_staleness=1)


def _group(gid: str, size: int, version: int) -> list[SampleMeta]:
    return [SampleMeta(f"{gid}-{i}", gid, size, version, {}, {}, True) for i in range(size)]


@pytest.mark.timeout(10)
def test_memory_get_returns_its_stale_drops_in_the_batch():
    q = MemoryController(capacity=32, consumer_groups=["trainer"], lease_timeout_s=30)
    for gid, v in (("old1", 0), ("old2", 1), ("ok", 4)):
        q.put(_group(gid, 2, v))
    b = q.get(GetRequest("trainer", num_groups=1, max_staleness=2, current_version=5))
    assert b.group_ids == ["ok"] and b.stale_groups == 2 and q.stats().dropped["trainer"]["stale"] == 4
    # an empty get reports the drops it made too; the next get has none left to report
    q.put(_group("old3", 2, 0))
    empty = q.get(GetRequest("trainer", num_groups=1, max_staleness=2, current_version=5, timeout=0.05))
    assert len(empty) == 0 and empty.stale_groups == 1
    assert q.get(GetRequest("trainer", num_groups=1, max_staleness=2, current_version=5)).stale_groups == 0
