"""`asyncrl status` prints a snapshot's strings as plain text only, and a snapshot of the wrong shape is
one line and exit 1 (issue 44, items 7 and 8).

The attack: whoever can write a run's `status.json` (or its Redis key) plants escape sequences (a window
title, a clipboard write over OSC 52, a clear screen), rich markup (a hyperlink) and wrong types or deep
nesting, then a user runs `asyncrl status` on it. A real snapshot (`SnapshotBuilder` of the stand-in
pipeline) with those strings in it, read by the real command in its own process.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.observe.test_command import _snap

EVIL = "\x1b]0;owned\x07\x1b]52;c;ZWNobyBvd25lZA==\x07\x1b[2J\x9b31m[link=https://evil.example]click[/link]\nline"


def _status(run_dir, *args):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", "--run", str(run_dir), *args],
                          capture_output=True, text=True, timeout=60)


def test_escape_sequences_and_markup_in_a_snapshot_print_as_plain_text(tmp_path):
    snap = _snap(tmp_path, error=EVIL, state="failed")
    snap["run"] = dict(snap["run"], name=EVIL)
    fleet = next(iter(snap["fleets"].values()))
    fleet["servers"][0]["name"] = EVIL
    snap[EVIL] = EVIL  # a key too
    (tmp_path / "status.json").write_text(json.dumps(snap))
    out = _status(tmp_path)
    assert out.returncode == 0, out.stderr
    for control in ("\x1b", "\x07", "\x9b"):
        assert control not in out.stdout
    assert "[link=https://evil.example]click[/link]" in out.stdout  # shown, not made a link
    as_json = _status(tmp_path, "--json")
    assert as_json.returncode == 0 and "\\u001b" not in as_json.stdout and "\x1b" not in as_json.stdout
    assert json.loads(as_json.stdout)["run"]["name"].startswith("]0;owned")


def test_a_snapshot_of_the_wrong_shape_is_one_line_and_exit_1(tmp_path):
    cases = {
        "wrong types": lambda s: s.update(trainer="x", queue=[1, 2], time="yesterday"),
        "a list": lambda s: None,
        "deep nesting": lambda s: None,
        "nested past the limit": lambda s: s.update(run={"a": json.loads("[" * 20 + "1" + "]" * 20)}),
        "not JSON": lambda s: None,
    }
    for name, spoil in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        snap = _snap(d)
        spoil(snap)
        text = {"a list": "[1, 2]", "not JSON": "{\"schema_version\": 1,",
                "deep nesting": "{\"schema_version\": 1, \"run\": " + "[" * 100_000 + "]" * 100_000 + "}"}.get(name) or json.dumps(snap)
        (d / "status.json").write_text(text)
        for args in ((), ("--json",)):
            out = _status(d, *args)
            if name == "wrong types" and args:  # JSON is printed as read: nothing to render
                assert out.returncode in (0, 1) and "Traceback" not in out.stderr, (name, out.stderr)
                continue
            assert out.returncode == 1, (name, args, out.stdout[-500:], out.stderr[-2000:])
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("asyncrl status: ") and "Traceback" not in out.stderr, (name, lines)
