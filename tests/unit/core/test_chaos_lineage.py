"""The chaos benchmark's accounting: which trained steps make up the final model."""

from asyncrl.bench.chaos import lineage


def test_a_step_trained_again_replaces_it_and_every_later_step_of_the_earlier_attempt():
    lines = [{"step": s, "uids": [f"a{s}"]} for s in (1, 2, 3, 4)]  # first attempt, killed after step 4
    lines += [{"step": s, "uids": [f"b{s}"]} for s in (3, 4, 5)]  # resumed from the checkpoint at step 2
    lines += [{"step": s, "uids": [f"c{s}"]} for s in (5, 6)]  # restarted again from step 4
    assert [(l["step"], l["uids"][0]) for l in lineage(lines)] == [(1, "a1"), (2, "a2"), (3, "b3"), (4, "b4"), (5, "c5"), (6, "c6")]


def test_no_restart_keeps_every_line():
    lines = [{"step": s, "uids": []} for s in range(1, 6)]
    assert lineage(lines) == lines


def test_server_faults_spare_servers_younger_than_the_interval():
    import subprocess
    import sys

    import psutil

    from asyncrl.bench.chaos import _age_s

    fresh = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _age_s(psutil.Process(fresh.pid)) < 10 < _age_s(psutil.Process(1))  # a server still starting; an old one
    finally:
        fresh.kill()
        fresh.wait()
    assert _age_s(_Gone()) == 0.0  # a process gone meanwhile is never picked


class _Gone:
    def create_time(self) -> float:
        import psutil

        raise psutil.NoSuchProcess(0)
