"""`asyncrl bench chaos --quick` as a test: recovery that a refactor breaks cannot land.

A real fully_async run on a Ray cluster of its own (2 trainer ranks, 2 servers, real processes; the
actors outlive the controller, `ray.detached`) with a real redis-server queue, while the bench's injector hangs a
rollout server with SIGSTOP, then SIGKILLs one every 6 s of the run (across the resume), one trainer rank once, and the whole controller once
(then resumes it with `resume=true`), with a reward that raises or hangs 5% of the time each. The
run must finish every step with no trajectory lost and none trained twice, its queue's counts
adding up. The run without faults (the wall-time ratio) is the bench's, not the test's.
"""

import pytest

SERVER_EVERY_S = 6.0
"""Seconds between server faults. The quick run lasts 20-45 s of wall on this machine (both segments); at the
bench's 10 s a fast run ended before the fault after the hang was due (a clean-clone run: the hang only), so the
kill this test asserts did not happen. At 6 s the hang comes at about 6 s and the kill at 12 s."""


@pytest.mark.timeout(900)
def test_chaos_quick_loses_nothing_and_trains_nothing_twice():
    from asyncrl.bench.chaos import QUICK_STEPS, run

    res = run(QUICK_STEPS, server_every=SERVER_EVERY_S, seed=0, baseline=False)
    faults = res["faults_injected"]
    assert faults["controller"] == 1 and faults["trainer_rank"] == 1, res
    assert faults["server"] >= 1 and faults["server_hung"] == 1, res
    assert res["segments"] == ["killed", "exited"], res
    assert res["trainer_restarts"] == 1 and res["actors_taken_back"] == 1, res  # the resume took the actors back
    assert res["completed"] and res["lost"] == 0 and res["trained_twice"] == 0, res
    assert res["shm"]["left_after_gc"] == 0, res["shm"]  # what its killed producers left, the gc of a next run takes
    assert res["queue_consistent"] and res["trained"] == QUICK_STEPS * 16, res
