"""`asyncrl bench --help`: every bench is listed with what it measures, its baseline and how long it takes."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

from asyncrl.bench.catalog import BENCHES, find, help_text
from asyncrl.cli import bench, main

ROOT = Path(__file__).resolve().parents[3]


def test_help_exits_0_and_lists_every_bench(capsys):
    assert bench(["--help"]) == 0
    out = capsys.readouterr().out
    for b in BENCHES:
        block = out.split(f"\n  {b.name}\n", 1)
        assert len(block) == 2, f"{b.name} not listed"
        entry = re.split(r"\n  (?! )", block[1], maxsplit=1)[0]
        assert "measures" in entry and "against" in entry and re.search(r"takes .*\d+ (s|min)", entry), entry


def test_no_bench_or_an_unknown_one_is_a_usage_error(capsys):
    assert bench([]) == 2
    assert "which bench?" in capsys.readouterr().err
    assert bench(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench 'nope'" in err and "rollout --fleet" in err


def test_every_module_of_asyncrl_bench_with_a_main_is_in_the_catalog():
    """A new bench module with a `main` shows up in `--help`, or this fails (helpers have no main)."""
    listed = {b.module for b in BENCHES}
    for b in BENCHES:
        assert callable(importlib.import_module(b.module).main), b.module
    mains = set()
    for f in (ROOT / "asyncrl" / "bench").glob("*.py"):
        if re.search(r"^def main\(", f.read_text(), re.M) and f.stem not in ("catalog", "__init__"):
            mains.add(f"asyncrl.bench.{f.stem}")
    helpers = {f"asyncrl.bench.{m}" for m in ("host_probes", "planes_hosts", "sim_cluster")}  # run by `planes --hosts`
    helpers.add("asyncrl.bench.trainer_memory")  # run by `trainer --shape`
    assert mains - helpers - listed == set(), "bench modules missing from asyncrl/bench/catalog.py"


def test_fleet_is_the_rollout_bench_with_fleet():
    b, rest = find(["rollout", "--json", "--fleet", "--quick"])
    assert b.module == "asyncrl.bench.fleet" and rest == ["--json", "--quick"]
    b, rest = find(["rollout", "--json"])
    assert b.module == "asyncrl.bench.rollout" and rest == ["--json"]


def test_the_command_line_and_the_docs_list_them_all():
    """`asyncrl --help` names every bench; the README's command list too."""
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == help_text()
    doc = main.__globals__["__doc__"]
    readme = (ROOT / "README.md").read_text()
    for b in BENCHES:
        assert b.name in doc, b.name
    line = next(ln for ln in readme.splitlines() if ln.startswith("asyncrl bench "))
    for b in BENCHES:
        assert all(w.strip("-") in line for w in b.name.split()), (b.name, line)
