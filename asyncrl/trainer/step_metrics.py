"""One trainer step's metrics from its mini-batches': the merge rule the engine applies.

Pure Python over metric dicts; knows nothing about models or ranks.
"""

from __future__ import annotations


def merge_minibatch_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One trainer step's metrics from its mini-batches' (means; sums for counts; extremes kept).

    >>> merge_minibatch_metrics([{"loss": 1.0, "tokens": 4, "ratio_max": 1.5}, {"loss": 3.0, "tokens": 6, "ratio_max": 1.2}])
    {'loss': 2.0, 'tokens': 10, 'ratio_max': 1.5}
    """
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):  # a key some mini-batches lack (a token age none of theirs has) merges over the others
        vals = [p[key] for p in parts if key in p]
        if key in ("tokens", "seqs") or key.endswith(("/tokens", "_tokens")):
            out[key] = sum(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out
