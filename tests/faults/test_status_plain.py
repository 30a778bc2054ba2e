"""`asyncrl status` prints a snapshot's strings as plain text only, and a snapshot of the wrong shape is
one line and exit 1 (issue 44, items 7 and 8): it is decoded into typed records (asyncrl/observe/schema.py),
and a field of the wrong type however deep is refused with its path, in every view.

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


def _one_line(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-2000:])
    assert lines[0].startswith("asyncrl status: ") and not out.stdout, (lines, out.stdout[-500:])
    return lines[0]


def test_a_wrong_field_deep_inside_is_one_line_naming_its_path(tmp_path):
    """Every field is typed (asyncrl/observe/schema.py): a wrong one deep inside, read by the view or only
    printed by --json, is refused by the decode with the path of the field, before anything is shown."""
    cases = {
        "in_flight a string": (lambda s: s["fleets"]["default"]["servers"][0].update(in_flight="3"),
                               "Expected `int`, got `str` - at `$.fleets[...].servers[0].in_flight`"),
        "a list for a map": (lambda s: s["queue"]["stats"].update(depth=[["trainer", 8]]),
                             "Expected `object`, got `array` - at `$.queue.stats.depth`"),
        "a map for a list": (lambda s: s["data_plane"].update(undelivered_frees={"endpoint": "x"}),
                             "Expected `array`, got `object` - at `$.data_plane.undelivered_frees`"),
        "a bool for a count": (lambda s: s["staleness"]["queue"].update({"1": True}),
                               "Expected `int`, got `bool` - at `$.staleness.queue[...]`"),
        "a required field gone": (lambda s: s["trainer"].pop("version"),
                                  "Object missing required field `version` - at `$.trainer`"),
        "an event's startup of text": (lambda s: s["fleets"]["default"].update(events=[
                                           {"time": 1.0, "kind": "start", "server": "s", "startup": {"total_s": "soon"}}]),
                                       "Expected `float`, got `str` - at `$.fleets[...].events[0].startup[...]`"),
    }
    for name, (spoil, why) in cases.items():
        d = tmp_path / name.replace(" ", "_").replace("'", "")
        d.mkdir()
        snap = _snap(d)
        spoil(snap)
        (d / "status.json").write_text(json.dumps(snap))
        for args in ((), ("--json",)):
            line = _one_line(_status(d, *args))
            assert line == f"asyncrl status: {d / 'status.json'}: not a status snapshot: {why}", (name, args, line)


def test_a_lifecycle_record_and_the_final_snapshot_under_it_are_typed_too(tmp_path):
    """`asyncrl train`'s short record (`status.json` without `schema_version`) and `status_final.json`, which the
    view lays it over, are checked each with its own type."""
    record = tmp_path / "record"
    record.mkdir()
    (record / "status.json").write_text(json.dumps({"pid": "1234", "time": 1.0, "state": "finished", "step": 3}))
    assert "at `$.pid`" in _one_line(_status(record))
    final = tmp_path / "final"
    final.mkdir()
    snap = _snap(final, state="finished")
    snap["weights"]["evicted"] = ["server-1"]
    (final / "status_final.json").write_text(json.dumps(snap))
    (final / "status.json").write_text(json.dumps({"pid": 1, "time": 1.0, "state": "finished", "step": 3}))
    line = _one_line(_status(final, "--json"))
    assert "status_final.json: not a status snapshot: Expected `object`, got `array` - at `$.weights.evicted`" in line


def test_unknown_keys_are_left_out_and_a_newer_queues_counter_is_read(tmp_path):
    """Forward compatible: a key the schema does not describe is not an error, and it is not shown (a planted
    `clock_offset_s` does not move the heartbeat's age); the queue's `forged` counter is typed when present
    and 0 when an older queue did not write it."""
    snap = _snap(tmp_path)
    snap["future_section"] = {"x": [1, 2]}
    snap["clock_offset_s"] = -3600.0
    snap["fleets"]["default"]["servers"][0]["future_field"] = "x"
    snap["queue"]["stats"]["forged"] = 2
    (tmp_path / "status.json").write_text(json.dumps(snap))
    out = _status(tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert "future_section" not in got and "clock_offset_s" not in got and got["liveness"]["alive"]
    assert "future_field" not in got["fleets"]["default"]["servers"][0] and got["queue"]["stats"]["forged"] == 2
    assert got["queue"]["ready"] == snap["queue"]["ready"] and got["staleness"] == snap["staleness"]
    del snap["queue"]["stats"]["forged"]
    snap["queue"]["stats"]["forged"] = "2"
    (tmp_path / "status.json").write_text(json.dumps(snap))
    assert "at `$.queue.stats.forged`" in _one_line(_status(tmp_path))
