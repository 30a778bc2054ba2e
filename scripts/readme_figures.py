"""The figures README.md quotes, measured by commands and written into it, never typed by hand.

    .venv/bin/python scripts/readme_figures.py train [--runs 3]   # the default job, alone, N times (~2 min each)
    .venv/bin/python scripts/readme_figures.py pipeline           # asyncrl bench pipeline --json (~1 min)
    .venv/bin/python scripts/readme_figures.py suite LOG [--wall-s S]
                                                                  # a `make test` log: passed, skipped, pytest seconds
    .venv/bin/python scripts/readme_figures.py write              # README.md's marked figures from docs/figures.json
    .venv/bin/python scripts/readme_figures.py check              # exit 1 if README.md differs from what `write` writes

Each measuring command stores its result, with the date, the commit and the machine's cores and load average, in
`docs/figures.json` and rewrites README.md. In README.md a figure sits between `<!-- figure:NAME -->` and
`<!-- /figure -->`; the text between is `render(NAME, ...)`'s and carries its date. `tests/unit/core/test_readme_figures.py`
runs `check`: a hand edit between the marks, or a figures.json whose text was not written, fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures.json"
README = ROOT / "README.md"
MARK = re.compile(r"<!-- figure:(?P<name>[a-z_]+) -->(?P<text>.*?)<!-- /figure -->", re.S)
REACHED = 0.8
OWN_TESTS = "tests/unit/core/test_readme_figures.py"
"""The tests of these figures: in a suite run before the suite's first record they fail (there is none yet), so
`suite` takes a log whose only failures are theirs (counted in the record as `own_tests_failed`)."""


def _where() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cores": os.cpu_count(),
            "load_avg": round(os.getloadavg()[0], 1)}


def _span(values: list, spec: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{format(lo, spec)}-{format(hi, spec)}"


def render(name: str, fig: dict) -> str:
    """The README text of figure `name` from its record in figures.json."""
    if name == "default_job":
        runs = fig["runs"]
        reached = [r for r in runs if r["first_step"] is not None]
        head = (f"held-out reward goes from {_span([r['reward_step0'] for r in runs], '.2f')} to {REACHED} in "
                f"{_span([r['first_step'] for r in reached], 'd')} steps ({_span([r['first_s'] for r in reached], '.0f')} s "
                f"of training on {fig['cores']} cores)" if reached else f"held-out reward did not reach {REACHED}")
        return (f"{head} and ends at {_span([r['final'] for r in runs], '.2f')} after {runs[0]['steps']} steps "
                f"({_span([r['wall_s'] for r in runs], '.0f')} s in all; {len(runs)} runs, {fig['date']})")
    if name == "suite":
        wall = f", {fig['wall_s'] / 60:.0f} with setup" if fig.get("wall_s") else ""
        return (f"The suite takes about {fig['pytest_s'] / 60:.0f} minutes of pytest on a {fig['cores']}-core machine "
                f"({fig['passed']} passed, {fig['skipped']} skipped in {fig['pytest_s']:.0f} s{wall}; {fig['date']})")
    if name == "pipeline":
        return f"it trains {fig['speedup_vs_sync']:.1f}x the tokens/s of sync ({fig['date']})"
    raise KeyError(f"no figure {name!r}")


def load() -> dict:
    return json.loads(FIGURES.read_text()) if FIGURES.exists() else {}


def written(readme: str, figures: dict) -> str:
    """`readme` with every marked figure's text rendered from `figures` (a figure with no record is kept)."""
    def one(m: re.Match) -> str:
        name = m["name"]
        text = render(name, figures[name]) if name in figures else m["text"]
        return f"<!-- figure:{name} -->{text}<!-- /figure -->"

    return MARK.sub(one, readme)


def save(name: str, record: dict) -> None:
    figures = load()
    figures[name] = {**record, **_where(), "command": " ".join(["scripts/readme_figures.py", *sys.argv[1:]])}
    FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    README.write_text(written(README.read_text(), figures))
    print(f"{name}: {render(name, figures[name])}")


def one_run(tmp: Path) -> dict:
    """`asyncrl train` (no arguments: the default job) in a fresh folder; its curve and times."""
    asyncrl = Path(sys.executable).parent / "asyncrl"
    subprocess.run([str(asyncrl), "train", f"logging.run_root={tmp}", "logging.run_name=r", "logging.mlflow=false",
                    "logging.progress=false"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (tmp / "r" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/reward"], r["time"]) for r in rows if "eval/reward" in r]
    t0 = evals[0][2]
    first = next(((s, t - t0) for s, reward, t in evals if reward >= REACHED), (None, None))
    summary = json.loads((tmp / "r" / "summary.json").read_text())
    return {"reward_step0": evals[0][1], "first_step": first[0], "first_s": first[1], "final": evals[-1][1],
            "steps": summary["steps"], "wall_s": summary["wall_s"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scripts/readme_figures.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train").add_argument("--runs", type=int, default=3)
    sub.add_parser("pipeline")
    s = sub.add_parser("suite")
    s.add_argument("log")
    s.add_argument("--wall-s", type=float, default=None, help="the whole command's seconds, setup included")
    sub.add_parser("write")
    sub.add_parser("check")
    a = p.parse_args(argv)
    if a.cmd == "train":
        runs = []
        for i in range(a.runs):
            with tempfile.TemporaryDirectory() as d:
                runs.append(one_run(Path(d)))
                print(f"run {i + 1} of {a.runs}: {runs[-1]}", flush=True)
        save("default_job", {"runs": runs})
    elif a.cmd == "pipeline":
        out = subprocess.run([str(Path(sys.executable).parent / "asyncrl"), "bench", "pipeline", "--json"],
                             capture_output=True, text=True, check=True).stdout
        res = json.loads(out[out.index("{"):])
        save("pipeline", {"speedup_vs_sync": res["modes"]["fully_async"]["speedup_vs_sync"]})
    elif a.cmd == "suite":
        text = Path(a.log).read_text()
        m = re.findall(r"^=* ?(?:(\d+) failed, )?(\d+) passed(?:, (\d+) skipped)?.* in ([\d.]+)s", text, re.M)
        if not m:
            print(f"{a.log}: no pytest result line", file=sys.stderr)
            return 2
        failed, passed, skipped, secs = m[-1]
        others = [ln for ln in re.findall(r"^FAILED (\S+)", text, re.M) if not ln.startswith(OWN_TESTS)]
        if others or (failed and not re.search(r"^FAILED ", text, re.M)):  # a suite figure comes from a green run
            print(f"{a.log}: {failed} tests failed; measure the suite on a green run", file=sys.stderr)
            return 2
        save("suite", {"passed": int(passed), "skipped": int(skipped or 0), "pytest_s": float(secs), "wall_s": a.wall_s,
                       "own_tests_failed": int(failed or 0)})
    elif a.cmd == "write":
        README.write_text(written(README.read_text(), load()))
    else:
        want = written(README.read_text(), load())
        if want != README.read_text():
            print("README.md's figures differ from docs/figures.json: run scripts/readme_figures.py write "
                  "(or measure them again)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
