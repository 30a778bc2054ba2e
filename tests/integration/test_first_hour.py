"""A verl user's first hour (issue 25), each trap met the way that user meets it: a local Qwen2-shaped folder and
GSM8K rows in verl's parquet layout, `asyncrl train` as a subprocess where the process itself matters (a real
Ctrl-C to its process group, a real local Ray after `deploy/ray/start_cluster.sh stop`), `asyncrl.cli.main` in
this process where a subprocess would add only start-up time. Every outcome is one line, and a run that did not
finish says why in `asyncrl status`.

1. a data path with no recipe selects the data task (and a digit task set beside it is a one-line stop);
2. Ctrl-C, an unreachable server, DAPO filtering that never fills a batch, a CUDA backend on a CPU machine, a crash
   in the run's build: one line each (no traceback), recorded in status.json / summary.json, shown by `asyncrl status`;
3. the GPU recipe runs 2 steps on this CPU machine with one switch, `hardware=cpu` (on its own Ray, as written);
4. after `start_cluster.sh stop` of a head this host started, that local Ray run starts (Ray's
   `ray_current_cluster` file no longer points at the dead cluster); the README's server command is
   `tests/vllm/test_readme_serve.py`'s.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.observe.command import main as status_main
from tests.integration.test_verl_recipe import qwen2_folder
from tests.unit.data.conftest import verl_row, write_parquet

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml")
BIN = Path(sys.executable).parent
TINY = ["trainer.total_steps=2", "trainer.prompts_per_step=2", "rollout.group_size=2", "data.eval_size=2",
        "trainer.eval_every=1", "trainer.save_every=0", "trainer.micro_batch_size=4", "rollout.max_tokens=8",
        "logging.mlflow=false", "logging.progress=false", "logging.num_generations=2"]
"""Sizes only (the recipe's are a GPU's): what a user shrinks for a first try, never a device setting."""


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Qwen2-shaped HF folder (ChatML tokenizer) and GSM8K rows in verl's parquet layout."""
    d = tmp_path_factory.mktemp("verl_user")
    model = qwen2_folder(d / "qwen2-tiny")
    train = write_parquet(d / "train.parquet", [verl_row(i) for i in range(16)])
    test = write_parquet(d / "test.parquet", [verl_row(100 + i) for i in range(4)])
    return {"model": model, "train": train, "test": test}


def _runs(tmp_path: Path, name: str) -> list[str]:
    return [f"logging.run_root={tmp_path}/runs", f"logging.run_name={name}", f"queue.shm_dir={tmp_path}"]


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("asyncrl:")]
    assert lines, err
    return lines[-1]


def _status(capsys: pytest.CaptureFixture, run: Path) -> str:
    capsys.readouterr()
    assert status_main(["--run", str(run)]) == 0
    return " ".join(capsys.readouterr().out.split())


def _asyncrl() -> list[str]:
    exe = BIN / "asyncrl"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "asyncrl.cli"]


# ---- 1. the data path selects the data task -----------------------------------------------------


@pytest.mark.timeout(120)
def test_a_data_path_without_a_recipe_trains_on_the_file(verl, tmp_path, capsys):
    args = ["train", f"model.path={verl['model']}", f"data.train_path={verl['train']}", *TINY, "trainer.total_steps=1",
            *_runs(tmp_path, "plain")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "asyncrl: data.task=jsonl (selected by data.train_path)" in out
    end = out[out.index("asyncrl: finished: "):].splitlines()  # a few rounded lines, not the summary's dicts
    assert end[0].startswith("asyncrl: finished: fully_async, 1 steps in ") and len(end) <= 7, end
    assert end[-1].endswith("plain/summary.json (curve: reward_curve.png, per step: metrics.jsonl)"), end
    gens = [json.loads(line) for line in (tmp_path / "runs" / "plain" / "generations.jsonl").read_text().splitlines()]
    assert gens and all("Natalia sold" in g["prompt"] for g in gens), gens[0]["prompt"]  # the parquet's, not `7416=`

    assert main(["train", "data.task=increment", f"data.train_path={verl['train']}", *_runs(tmp_path, "both")]) == 2
    line = _last_line(capsys.readouterr().err)
    assert line == ("asyncrl: config error: data.train_path: given, but data.task=increment is a built-in task that "
                    "reads no file; set data.task=jsonl to train on the file, or drop data.train_path for the built-in task")
    assert not (tmp_path / "runs" / "both").exists()


# ---- 2. runtime stops are one line, recorded, shown ---------------------------------------------


def interruptible() -> None:
    """In the child before it execs: SIGINT at its default and unblocked, whatever this process inherited
    or a library did to its own disposition (a child of an ignoring parent ignores SIGINT for life, and
    Python then installs no KeyboardInterrupt handler): the test is about how asyncrl handles Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def signal_masks(pid: int) -> str:
    """The kernel's view of a process's ignored and blocked signals (what `signal.getsignal` cannot show)."""
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        return "no /proc status"
    return ", ".join(ln.replace("\t", " ") for ln in lines if ln.startswith(("SigIgn", "SigBlk")))


@pytest.mark.timeout(420)
def test_ctrl_c_is_one_line_rc_130_and_status_says_how_to_resume(tmp_path, capsys):
    run = tmp_path / "runs" / "ctrlc"
    cmd = [*_asyncrl(), "train", "trainer.total_steps=2000", "trainer.save_every=2", "trainer.prompts_per_step=2",
           "rollout.group_size=2", "data.eval_size=2", "trainer.eval_every=1000", "trainer.minibatches=1",
           "logging.mlflow=false", "logging.progress=false", f"model.cache_dir={tmp_path}/models", *_runs(tmp_path, "ctrlc")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"),  # one that does not stop dumps its threads (below)
                            preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads((run / "status.json").read_text()).get("trainer", {}).get("step", 0) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the whole foreground group
        try:  # a loaded machine (another job beside the suite) slows the stop, not what it ends with
            out, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            masks = signal_masks(proc.pid)
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"no stop 150 s after Ctrl-C ({masks}); its threads:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    line = _last_line(err)
    assert line.startswith("asyncrl: interrupted at step ") and " (last checkpoint: step " in line, line
    step = int(line.split("at step ")[1].split()[0])
    resume = line.split("resume with: ")[1]
    assert resume.endswith("resume=true logging.run_name=ctrlc"), resume
    assert len([ln for ln in err.splitlines() if ln.startswith("asyncrl:")]) == 1, err
    shown = _status(capsys, run)
    assert f"interrupted at step {step} " in shown and "resume with: asyncrl train" in shown, shown
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["steps"] == step and summary["resume_command"] == resume
    assert "KeyboardInterrupt" in (run / "error.log").read_text()

    ckpt = int(line.split("last checkpoint: step ")[1].split(")")[0])
    again = shlex.split(resume)[1:] + [f"trainer.total_steps={ckpt + 1}"]  # the printed command; one step further
    assert main(again) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed"] is True and summary["steps"] == ckpt + 1


@pytest.mark.timeout(60)
def test_an_unreachable_server_url_is_named_before_ray_or_a_run_directory(verl, tmp_path, capsys):
    import ray

    args = ["train", f"model.path={verl['model']}", f"data.train_path={verl['train']}", "rollout.backend=openai",
            "rollout.server_urls=[http://127.0.0.1:9]", "rollout.external_weights=frozen", "ray.enabled=true",
            *_runs(tmp_path, "url")]
    assert main(args) == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("asyncrl: config error: rollout.server_urls[0]: no OpenAI-compatible server answers at "
                           "http://127.0.0.1:9 (GET http://127.0.0.1:9/v1/models: ConnectError"), line
    assert line.endswith("start the server first (README: \"Rollout on servers you run\") or fix the URL"), line
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


@pytest.mark.timeout(120)
def test_dapo_filtering_that_never_fills_a_batch_is_one_line_and_in_status(verl, tmp_path, capsys):
    args = ["train", RECIPE, f"model.path={verl['model']}", f"data.train_path={verl['train']}",
            f"data.eval_path={verl['test']}", "hardware=cpu", "ray.enabled=false", *TINY, "algorithm.filter_groups=true",
            "algorithm.filter_groups_max_batches=1", *_runs(tmp_path, "dapo")]
    assert main(args) == 1  # a random tiny model never solves GSM8K: every group's rewards are equal (0)
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("asyncrl: stopped: algorithm.filter_groups: 2 groups in a row were dropped"), line
    assert "algorithm.filter_groups_max_batches=1" in line
    run = tmp_path / "runs" / "dapo"
    assert "failed: algorithm.filter_groups: 2 groups in a row" in _status(capsys, run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "failed" and summary["error_type"] == "EndlessFiltering" and summary["error"] == line[len("asyncrl: stopped: "):]
    assert "Traceback" in (run / "error.log").read_text()


@pytest.mark.timeout(60)
def test_a_cuda_backend_on_a_cpu_machine_names_the_fix(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["train", "ray.enabled=true", "weights.backend=cuda_ipc", "weights.device=cuda", *_runs(tmp_path, "ipc")]) == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("asyncrl: config error: weights.device: cuda, but this machine has no usable CUDA GPU"), line
    assert "weights.backend=shm" in line and line.endswith("or add hardware=cpu, which moves every GPU setting to CPU at once")
    assert main(["train", "weights.backend=cuda_ipc", *_runs(tmp_path, "ipc")]) == 2  # the weight plane's own check
    assert _last_line(capsys.readouterr().err).endswith("with weights.backend=shm (one host) or gloo, or hardware=cpu")


@pytest.mark.timeout(60)
def test_a_crash_while_the_run_is_built_is_recorded_and_shown(tmp_path, capsys, monkeypatch):
    import asyncrl.launch

    def build(cfg, run_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(asyncrl.launch, "build", build)
    args = ["train", "trainer.total_steps=1", "logging.mlflow=false", f"model.cache_dir={tmp_path}/models", *_runs(tmp_path, "crash")]
    assert main(args) == 1
    run = tmp_path / "runs" / "crash"
    line = _last_line(capsys.readouterr().err)
    assert line == (f"asyncrl: failed: OSError: [Errno 28] No space left on device (traceback: {run / 'error.log'}; "
                    "--debug prints it)")
    assert "failed: OSError: [Errno 28] No space left on device" in _status(capsys, run)  # not `dead ... last state starting`
    assert 'raise OSError(28, "No space left on device")' in (run / "error.log").read_text()
    with pytest.raises(OSError):
        main(["--debug", *args[:-1], "logging.run_name=crash-debug"])


# ---- 3 and 4: the GPU recipe on CPU with one switch, on a local Ray after a stopped cluster ------


@pytest.mark.timeout(240)
def test_the_gpu_recipe_runs_on_cpu_with_hardware_cpu_after_a_stopped_local_cluster(verl, tmp_path):
    pytest.importorskip("ray")
    ray_tmp = Path(tempfile.mkdtemp(prefix="fh-", dir="/tmp"))  # RAY_TMPDIR: this test's Ray only; socket paths stay short
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), RAY_AUTH_TOKEN=secrets.token_hex(16), RAY=str(BIN / "ray"),
               PYTHON=sys.executable, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    script, pid_file = str(ROOT / "deploy" / "ray" / "start_cluster.sh"), tmp_path / "head.pid"
    current = ray_tmp / "ray" / "ray_current_cluster"  # where `ray start` writes the address `ray.init()` joins
    try:
        subprocess.run([script, "head", "--ip", "127.0.0.1", "--port", str(_free_port()), "--num-cpus", "1",
                        "--pid-file", str(pid_file), "--", "--dashboard-port", str(_free_port()),
                        "--ray-client-server-port", str(_free_port())],
                       env=env, check=True, timeout=60)
        deadline = time.monotonic() + 60
        while not current.exists() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert current.exists(), (pid_file.parent / "head.pid.log").read_text()[-2000:]
        subprocess.run([script, "stop", "--pid-file", str(pid_file)], env=env, check=True, timeout=60)
        assert not current.exists(), "start_cluster.sh stop left ray_current_cluster pointing at the stopped head"

        cmd = [*_asyncrl(), "train", RECIPE, f"model.path={verl['model']}", f"data.train_path={verl['train']}",
               f"data.eval_path={verl['test']}", "hardware=cpu", *TINY, *_runs(tmp_path, "cpu")]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    finally:
        subprocess.run([script, "stop", "--pid-file", str(pid_file)], env=env, timeout=60, check=False)
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("asyncrl: hardware=cpu: trainer.device=cpu weights.device=cpu weights.backend=shm model.dtype=float32 "
            "rollout.gpu_bundles=false rollout.backend=torch rollout.enforce_eager=true") in done.stdout
    assert "Started a local Ray instance" in done.stderr  # the recipe's ray.enabled=true, on a fresh local Ray
    run = tmp_path / "runs" / "cpu"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 2 * 2
    resolved = (run / "config.yaml").read_text()
    assert "hardware: cpu" in resolved and "backend: shm" in resolved


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
