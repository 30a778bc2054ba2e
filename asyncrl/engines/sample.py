"""`Sample`: one member of a group as the rollouter hands it to an AgentLoop (and, msgpack-encoded,
to a server actor's host).

Job: the one small type both sides need. It lives here, below `agents`, so the rollouter and the
server host hand samples out without importing `agents` (which imports `asyncrl.engines.base`);
agents import it from here. Boundary: data only, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One member of a GRPO group, as handed to an AgentLoop."""

    uid: str
    group_id: str
    index_in_group: int
    group_size: int
    prompt_ids: list[int]
    answer: str
    """Reference answer for the reward function."""
    meta: dict[str, Any] = field(default_factory=dict)
