"""A receiver leaves a weight plane whose sender died mid-update at once, not after the update's timeout.

The case behind it: a trainer rank is killed while it publishes; the run restarts the trainer and every
server joins the new one (`RolloutServer`-side `join_weights` first leaves the old plane). The server's
weights thread is then waiting for the next bucket of the dead sender's update, a wait of
`3 * weights.timeout_s + 5` s (95 s by default); the join waited for it, the fleet's control call timed
out (`rollout.health_timeout_s`, 60 s) and a healthy server was killed as hung and replaced.

Real: the sender is a `Sender` in its own process over gloo (a real torch.distributed group) and shm,
SIGKILLed once the receiver (this process) landed a tensor of its update."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from checkpoint_engine import Receiver, UpdateAborted, WeightsConfig

ROOT = Path(__file__).resolve().parents[3]
SENDER = r"""
import json, sys, time, torch
from checkpoint_engine import Sender, WeightsConfig
cfg = WeightsConfig(**json.loads(sys.argv[1]))
sender = Sender(cfg)
open(sys.argv[2] + ".tmp", "w").write(sender.endpoint)
import os; os.replace(sys.argv[2] + ".tmp", sys.argv[2])
sender.wait_for(1, timeout_s=60)
state = {f"w{i}": torch.full((256, 256), float(i)) for i in range(16)}  # 16 buckets of 256 KiB
sender.publish(state.items(), 1)
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_receiver_whose_sender_died_mid_update_leaves_at_once(backend, tmp_path):
    cfg = WeightsConfig(backend=backend, bucket_size_mb=0.25, timeout_s=30.0, straggler_s=0.0)
    endpoint_file = tmp_path / "endpoint"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    sender = subprocess.Popen([sys.executable, "-c", SENDER, json.dumps(asdict(cfg)), str(endpoint_file)], env=env)
    rx = None
    try:
        deadline = time.monotonic() + 60
        while not endpoint_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint_file.exists(), "the sender never started"
        rx = Receiver(cfg, "server-0", endpoint=endpoint_file.read_text(), confirm_loads=True)
        update = rx.next_update(60)
        outcome: dict = {}

        def load() -> None:
            t0 = time.monotonic()
            try:
                for name, tensor in update:
                    if "first" not in outcome:
                        outcome["first"] = (name, float(tensor[0, 0]))
                        sender.send_signal(signal.SIGKILL)  # the sender dies with the rest of the update unsent
                        sender.wait()
                        outcome["killed_at"] = time.monotonic()
            except BaseException as e:  # what the leave makes of the wait
                outcome["error"] = e
            outcome["ended_at"] = time.monotonic()
            outcome["took"] = outcome["ended_at"] - t0

        loader = threading.Thread(target=load)
        loader.start()
        deadline = time.monotonic() + 60
        while "killed_at" not in outcome and loader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "killed_at" in outcome, f"no tensor landed before the kill: {outcome}"
        time.sleep(1.0)
        assert loader.is_alive(), f"the update ended by itself: {outcome}"  # still waiting on the dead sender
        left_at = time.monotonic()
        rx.leave()
        loader.join(10)
        assert not loader.is_alive(), "leave() did not end the wait for the dead sender's next bucket"
        assert isinstance(outcome.get("error"), UpdateAborted), outcome
        assert outcome["ended_at"] - left_at < 5.0  # the update's own timeout: 3 * 30 + 5 s
        assert outcome["first"][0] == "w0" and outcome["first"][1] == 0.0
        assert not update.complete and rx.version == -1  # nothing half-received counts as loaded
        with pytest.raises(UpdateAborted):  # a receiver that left waits for nothing more
            rx.next_update(None)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
        if rx is not None:
            rx.close()


def test_serve_updates_waits_without_waking_its_loop_and_stops_at_once():
    """The server's update loop waits for the sender with no timeout (no wake-ups of its event loop while
    idle) and still ends within a moment of `stop`."""
    import asyncio

    from checkpoint_engine import Sender
    from checkpoint_engine.server_loop import serve_updates

    class Server:
        loads_in_place = False

        async def pause(self, mode="wait"): ...

        async def load_update(self, update): ...

        async def resume(self): ...

    cfg = WeightsConfig(backend="shm")
    sender = Sender(cfg)
    rx = Receiver(cfg, "server-0", endpoint=sender.endpoint, confirm_loads=True)

    async def go() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        scheduled = 0
        originals = {name: getattr(loop, name) for name in ("call_soon", "call_soon_threadsafe")}

        def counting(name):
            def call(*a, **k):
                nonlocal scheduled
                scheduled += 1
                return originals[name](*a, **k)
            return call

        stop = asyncio.Event()
        task = asyncio.ensure_future(serve_updates(Server(), rx, stop=stop))
        await asyncio.sleep(0.3)
        for name in originals:  # what the loop is asked to run while the server waits, idle
            setattr(loop, name, counting(name))
        await asyncio.sleep(2.0)
        for name, fn in originals.items():
            setattr(loop, name, fn)
        t0 = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 5)
        return time.monotonic() - t0, scheduled

    try:
        took, scheduled = asyncio.run(go())
    finally:
        rx.close()
        sender.close()
    assert took < 1.0, took
    assert scheduled <= 2, scheduled  # a wait of 0.2 s at a time: 31 calls in those 2 s
