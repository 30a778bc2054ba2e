"""How the rows of a mini-batch are spread over the trainer's ranks: by tokens, as many slots each.

Pure Python (no torch): the plan the controller builds (`plan.BatchPlan.shard`, lengths from the handles'
shapes) and the full-batch path (`batch.TrainBatch.shard`, lengths from the attention mask) use the same
function, so both give every rank the same rows.
"""

from __future__ import annotations

from typing import Sequence


def spread(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Row indices of each of `world` ranks: every rank at most ceil(n / world) rows, tokens balanced. Rows
    go longest first (ties: lower index first) to the rank with the fewest tokens among those with room
    (ties: the lower rank); each rank's rows in index order. Deterministic: every rank computes the same.

    >>> spread([100, 90, 5, 5, 80, 5], 2)      # 110 | 175 tokens; by count, [0, 1, 2] | [3, 4, 5]: 195 | 90
    [[0, 2, 3], [1, 4, 5]]
    >>> spread([1, 1, 1], 4)
    [[0], [1], [2], []]
    """
    per = -(-len(lengths) // world) if lengths else 0
    ranks: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(world) if len(ranks[r]) < per), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += int(lengths[i])
    return [sorted(r) for r in ranks]
