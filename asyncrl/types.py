"""Wire records of the control plane: what one rollout produced, encoded with msgpack.

A `Trajectory` is the unit that crosses processes between rollout fleets, the
TransferQueue and the trainer. It is a typed record with a schema version; it is
encoded with msgpack through a msgspec Struct (`TrajectoryWire`: per-token arrays as raw
little-endian buffers with dtype and length), never pickle, so a peer cannot make us execute anything.

This module knows nothing about queues, tensors on devices or models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from plane_common.strict_msgpack import decoder
from transfer_queue.rules import staleness

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
        """Trainer version at use minus the oldest version that generated any token (`transfer_queue.rules.staleness`)."""
        return staleness(self.min_version, current_version)

    # ---- msgpack codec (the `TrajectoryWire` Struct) ---------------------
    def to_bytes(self) -> bytes:
        w = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, dt in _TOKEN_ARRAYS.items():
            w[name] = np.asarray(w[name], dtype=np.dtype(dt).newbyteorder("<")).tobytes()
        return _encoder.encode(TrajectoryWire(schema=SCHEMA_VERSION, **w))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Trajectory":
        try:
            w = _decoder.decode(data)
        except msgspec.ValidationError as e:
            raise WireError(f"trajectory: {e}") from None
        except (msgspec.DecodeError, ValueError, RecursionError) as e:  # not msgpack, ext types refused
            raise WireError(f"trajectory: not a msgpack record ({e})") from None
        if w.schema != SCHEMA_VERSION:
            raise WireError(f"trajectory: schema {w.schema!r}, expected {SCHEMA_VERSION}")
        kw = {f.name: getattr(w, f.name) for f in dataclasses.fields(cls)}
        for name, dt in _TOKEN_ARRAYS.items():
            d = np.dtype(dt).newbyteorder("<")
            if len(kw[name]) % d.itemsize:
                raise WireError(f"trajectory: field {name!r} has a truncated buffer")
            kw[name] = np.frombuffer(kw[name], dtype=d).tolist()
        return cls(**kw).validate()


class TrajectoryWire(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`Trajectory` on the wire: the same fields, per-token arrays as raw little-endian buffers
    (`response_ids` int32, `behavior_logprobs` float32, `loss_mask` int8, `token_versions` int32),
    and `_schema` (`SCHEMA_VERSION`); types and required fields checked by msgspec on decode, the
    invariants by `Trajectory.validate`."""

    schema: int = msgspec.field(name="_schema")
    uid: str
    group_id: str
    index_in_group: int
    group_size: int
    prompt_ids: list[int]
    response_ids: bytes
    behavior_logprobs: bytes
    loss_mask: bytes
    token_versions: bytes
    min_version: int
    max_version: int
    reward: float = 0.0
    reward_info: dict[str, Any] = {}
    finish_reason: str = "stop"
    meta: dict[str, Any] = {}
    timings: dict[str, float] = {}


_encoder = msgspec.msgpack.Encoder()
_decoder = decoder(TrajectoryWire)
