"""README.md's figures are the ones `scripts/readme_figures.py` measured (docs/figures.json), each with its date."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
figures = runpy.run_path(str(ROOT / "scripts" / "readme_figures.py"))


def test_readme_matches_the_measured_figures():
    assert figures["main"](["check"]) == 0  # a hand edit between the marks fails here


def test_every_marked_figure_has_a_record_with_its_date_and_command():
    recorded = figures["load"]()
    names = [m["name"] for m in figures["MARK"].finditer((ROOT / "README.md").read_text())]
    assert set(names) == {"default_job", "pipeline", "suite"}, names
    for name in names:
        rec = recorded[name]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]) and rec["commit"] and rec["command"].startswith("scripts/")
        assert rec["date"] in figures["render"](name, rec)


def test_a_hand_edit_is_caught_and_write_restores_it():
    readme = (ROOT / "README.md").read_text()
    edited = re.sub(r"(<!-- figure:suite -->)[^<]*", r"\1The suite takes 5 minutes", readme)
    assert edited != readme
    assert figures["written"](edited, figures["load"]()) == readme


def test_render_of_a_run_that_never_reached_the_level():
    runs = [{"reward_step0": 0.02, "first_step": None, "first_s": None, "final": 0.7, "steps": 300, "wall_s": 100.0}]
    text = figures["render"]("default_job", {"runs": runs, "cores": 2, "date": "2026-12-07"})
    assert text.startswith("held-out reward did not reach 0.8 and ends at 0.70 after 300 steps")
