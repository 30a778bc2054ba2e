"""Wire records of the control plane: what one rollout produced, encoded with msgpack.

A `Trajectory` is the unit that crosses processes between rollout fleets, the
TransferQueue and the trainer. It is a typed record with a schema version; it is
encoded with msgpack (per-token arrays as raw little-endian buffers with dtype and
length), never pickle, so a peer cannot make us execute anything.

This module knows nothing about queues, tensors on devices or models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1

# per-token arrays and their dtypes; all share len(response_ids)
_TOKEN_ARRAYS = {
    "response_ids": np.int32,
    "behavior_logprobs": np.float32,
    "loss_mask": np.int8,
    "token_versions": np.int32,
}


class WireError(ValueError):
    """A message that does not decode into a valid record."""


@dataclass
class Trajectory:
    """One finished rollout of one prompt (one member of a GRPO group).

    Invariants (checked by `validate`):
    - `response_ids`, `behavior_logprobs`, `loss_mask` and `token_versions` all have
      length `len(response_ids)`;
    - `loss_mask[i]` is 1 for tokens the policy generated and 0 for tokens written by a
      tool or environment (those are never trained on);
    - `token_versions[i]` is the policy version that produced token i (-1 for tool
      tokens), and `min_version <= max_version` bound the generated tokens' versions;
    - `0 <= index_in_group < group_size`.
    """

    uid: str
    """Unique id of this trajectory (stable across redeliveries)."""
    group_id: str
    """Id shared by the `group_size` samples of one prompt (GRPO group)."""
    index_in_group: int
    group_size: int
    prompt_ids: list[int]
    """Token ids of the prompt, as given to the rollout server."""
    response_ids: list[int]
    """Every token after the prompt: generated tokens and tool/env tokens."""
    behavior_logprobs: list[float]
    """Per response token: log-prob of that token under the policy that sampled it (0 for tool tokens)."""
    loss_mask: list[int]
    token_versions: list[int]
    min_version: int
    max_version: int
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    """Free-form, msgpack-encodable details from the reward function (e.g. `{"acc": 1.0}`)."""
    finish_reason: str = "stop"
    """`stop` (stop token), `length` (token budget), `abort` (cut by a weight update and not resumed), `error`."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Agent/turn metadata: agent name, number of turns, data index, ..."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase (`generate`, `reward`, `tools`), plus `created` (unix time)."""

    def validate(self) -> "Trajectory":
        n = len(self.response_ids)
        for name in ("behavior_logprobs", "loss_mask", "token_versions"):
            if len(getattr(self, name)) != n:
                raise WireError(f"trajectory {self.uid}: len({name})={len(getattr(self, name))} != len(response_ids)={n}")
        if not 0 <= self.index_in_group < max(self.group_size, 1):
            raise WireError(f"trajectory {self.uid}: index_in_group={self.index_in_group} outside group_size={self.group_size}")
        if self.min_version > self.max_version:
            raise WireError(f"trajectory {self.uid}: min_version {self.min_version} > max_version {self.max_version}")
        return self

    @property
    def num_generated_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def staleness(self, current_version: int) -> int:
        """Trainer version at use minus the oldest version that generated any token."""
        return current_version - self.min_version

    # ---- msgpack codec -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _TOKEN_ARRAYS:
                v = np.asarray(v, dtype=_TOKEN_ARRAYS[f.name]).astype("<" + np.dtype(_TOKEN_ARRAYS[f.name]).str[1:]).tobytes()
            d[f.name] = v
        d["_schema"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        if not isinstance(d, dict):
            raise WireError(f"trajectory: expected a map, got {type(d).__name__}")
        if d.get("_schema") != SCHEMA_VERSION:
            raise WireError(f"trajectory: schema {d.get('_schema')!r}, expected {SCHEMA_VERSION}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireError(f"trajectory: missing field {f.name!r}")
                continue
            v = d[f.name]
            if f.name in _TOKEN_ARRAYS:
                if not isinstance(v, (bytes, bytearray)):
                    raise WireError(f"trajectory: field {f.name!r} must be bytes")
                dt = np.dtype(_TOKEN_ARRAYS[f.name]).newbyteorder("<")
                if len(v) % dt.itemsize:
                    raise WireError(f"trajectory: field {f.name!r} has a truncated buffer")
                v = np.frombuffer(v, dtype=dt).tolist()
            kwargs[f.name] = v
        try:
            return cls(**kwargs).validate()
        except TypeError as e:  # wrong field types
            raise WireError(f"trajectory: {e}") from e

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Trajectory":
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise WireError(f"trajectory: not a msgpack record ({e})") from e
        return cls.from_dict(d)
