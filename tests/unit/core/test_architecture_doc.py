"""docs/architecture.md, the map of the code, against the tree: it names nothing that is gone and misses no package.

- every backticked path of the page that looks like a repository path (it contains `/` or ends in `.py`, and
  holds only path characters: `<run_dir>/control/` or `tq:<run_id>:` are not paths) exists, either from the
  repository root or under a folder that a heading above it names (`cli.py` under "## `asyncrl/`" is
  `asyncrl/cli.py`; `metadata/` in "## `transfer_queue/` (`metadata/`)" is `transfer_queue/metadata/`);
- every Python package (a folder with `__init__.py`, tests and `__pycache__` aside) of the five top-level
  packages is named by one such path, so a new package needs its row.
Fenced code blocks are not read. Pure text and `os.stat`: well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("asyncrl", "transfer_queue", "checkpoint_engine", "plane_common", "agents")

_TICKED = re.compile(r"`([^`\n]+)`")
_PATHLIKE = re.compile(r"[A-Za-z0-9_.\-/]+")
_HEADING = re.compile(r"(#+)\s")


def looks_like_path(token: str) -> bool:
    return bool(_PATHLIKE.fullmatch(token)) and not token.startswith("/") and ("/" in token or token.endswith(".py"))


def resolve(token: str, bases: list[Path], root: Path = ROOT) -> Path | None:
    """The file or folder `token` names: from the root, else under the heading folders in `bases`' order."""
    want_dir = token.endswith("/")
    rel = token.rstrip("/")
    for base in [root, *bases]:
        p = base / rel
        if (p.is_dir() if want_dir else p.exists()):
            return p
    return None


def scan(text: str, root: Path = ROOT) -> tuple[set[Path], list[str]]:
    """(every path the page names, resolved; one message per path that names nothing)."""
    named: set[Path] = set()
    missing: list[str] = []
    levels: dict[int, list[Path]] = {}  # heading level -> the folders that heading names
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            levels = {k: v for k, v in levels.items() if k < level}
            levels[level] = []
        # the deepest heading first, and a heading's folders in their order ("## `agents/` (`tools/`)":
        # `base.py` is agents/base.py; under "### `asyncrl/config/`", `__init__.py` is the config's)
        bases = [b for k in sorted(levels, reverse=True) for b in levels[k]]
        for token in _TICKED.findall(line):
            if not looks_like_path(token):
                continue
            p = resolve(token, bases, root)
            if p is None:
                missing.append(f"docs/architecture.md:{n}: `{token}` names no file or folder of the repository")
                continue
            named.add(p)
            if heading and p.is_dir():
                levels[level].append(p)
                bases.insert(len(levels[level]) - 1, p)
    return named, missing


def packages(root: Path = ROOT) -> list[Path]:
    out = []
    for top in PACKAGES:
        for init in (root / top).rglob("__init__.py"):
            d = init.parent
            if not {"tests", "__pycache__"} & set(d.relative_to(root).parts):
                out.append(d)
    return sorted(out)


def test_every_path_exists():
    named, missing = scan(DOC.read_text())
    assert not missing, "the map names what is gone (fix docs/architecture.md):\n" + "\n".join(missing)
    assert len(named) > 100, f"only {len(named)} paths found in docs/architecture.md: is the scan broken?"


def test_every_package_is_named():
    named, _ = scan(DOC.read_text())
    absent = [f"{d.relative_to(ROOT)}/" for d in packages() if d not in named]
    assert not absent, ("packages missing from docs/architecture.md (add a row or a heading naming each):\n"
                        + "\n".join(absent))


def test_the_scan_catches_a_gone_path_and_resolves_headings(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("")
    for d in ("pkg", "pkg/sub"):
        (tmp_path / d / "base.py").write_text("")
    text = ("# Map\n\n## `pkg/` (`sub/`)\n\n| `mod.py` | `gone.py` | `base.py` |\n\n```\n`fenced/gone.py`\n```\n\n"
            "### `pkg/sub/`\n\n`__init__.py`\n\n"
            "## Other\n\n`mod.py` `<run>/x/` `a.b=c` `pkg/sub/__init__.py`\n")
    named, missing = scan(text, tmp_path)
    assert resolve("base.py", [tmp_path / "pkg", tmp_path / "pkg" / "sub"], tmp_path) == tmp_path / "pkg" / "base.py"
    assert tmp_path / "pkg" / "sub" / "base.py" not in named  # the heading's first folder wins
    assert [m.split(": ", 1)[1] for m in missing] == [
        "`gone.py` names no file or folder of the repository",
        "`mod.py` names no file or folder of the repository",  # no heading folder in force here
    ]
    assert {tmp_path / "pkg", tmp_path / "pkg" / "sub", tmp_path / "pkg" / "mod.py"} <= named
