"""How a bench ends: its figures stamped with the bench's wall seconds, printed as JSON or as its table.

Shared by the benches that print `bench_wall_s` (`pipeline`, `planes`), and `pyplot` by those that draw
(`corrections`, `learn`); it knows nothing of what the figures are (each bench passes its own `print_table`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable


def finish(res: dict[str, Any], started: float, as_json: bool, print_table: Callable[[dict[str, Any]], None]) -> int:
    """Stamp `res["bench_wall_s"]` (seconds since `started`, a `time.time()`), print `res` as JSON
    (`--json`) or with `print_table`, and return the exit status 0."""
    res["bench_wall_s"] = round(time.time() - started, 1)
    if as_json:
        print(json.dumps(res, indent=1))
    else:
        print_table(res)
    return 0


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is not installed (a bench then
    says "no plot")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
