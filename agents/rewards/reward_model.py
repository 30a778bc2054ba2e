"""Reward-model hook: score a response by POSTing JSON to a reward-model server.

Request body: `{"response": ..., "ground_truth": ..., **extra}`; the server answers a JSON
object with a number under `score_key` (default `reward`); its other scalar fields become
`reward_info`. The HTTP call has its own timeout (`timeout_s`), and runs under the agent's
reward timeout as well; any failure (connection refused, HTTP error, bad JSON) raises, and
`agents.scoring.score` counts it as a failed reward. Proxies from the environment are ignored
(reward servers sit next to the rollout fleet). Select it from config with its URL:
`get_reward("reward_model", url="http://rm:8000/score", timeout_s=5)`.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MAX_REPLY_BYTES = 1 << 20


def reward_model(
    response: str,
    ground_truth: str,
    *,
    url: str,
    timeout_s: float = 10.0,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    score_key: str = "reward",
) -> tuple[float, dict[str, Any]]:
    body = json.dumps({"response": response, "ground_truth": ground_truth, **(extra or {})}).encode()
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    with _OPENER.open(req, timeout=timeout_s) as reply:
        out = json.loads(reply.read(MAX_REPLY_BYTES))
    if not isinstance(out, dict) or not isinstance(out.get(score_key), (int, float)):
        raise ValueError(f"reward model at {url}: reply has no number under {score_key!r}")
    info = {k: v for k, v in out.items() if k != score_key and isinstance(v, (int, float, str, bool))}
    return float(out[score_key]), info
