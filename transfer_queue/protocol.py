"""The controller service's wire: the request and reply envelopes and one args Struct per op.

A request is `Request{id, op, args}`; `args` stays raw until `op` names its Struct, so the
service decodes it with that op's typed decoder (`ARGS[op]`): the field set is exact, every
field has its type, counts are in [0, MAX_COUNT], timeouts in [0, MAX_SECONDS] or nil (NaN,
inf, negatives refused), names are bounded strings. A reply is `Reply{id, ok, result |
error, kind}`; the caller decodes `result` with its op's decoder (`RESULTS`). This module
checks form only: what a peer may do (ownership, capacity, the run's plane) is the
service's and the controller's.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from plane_common.strict_msgpack import decoder
from transfer_queue.codec import MAX_COUNT, MAX_INT, MAX_SECONDS
from transfer_queue.records import QueueStats, SampleMeta, Batch, Text
from transfer_queue.storage.handles import Handle

Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
Int = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
Uids = Annotated[list[str], msgspec.Meta(max_length=MAX_COUNT)]
ClientId = Text
"""The caller: the token `hello` gave it (the service acts as the identity behind the token; with
`queue.secret` an unknown token is refused), or, on a service without a secret, a name taken as given.
Who may act on records: `rules.may_act`."""


class _Args(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class PutArgs(_Args):
    samples: list[SampleMeta]
    """At most `queue.capacity` (checked by the service)."""
    timeout: Seconds | None
    client_id: ClientId


class UpdateArgs(_Args):
    uid: Text
    handles: dict[str, Handle]
    meta: dict[str, Any]
    seal: bool
    client_id: ClientId


class GetArgs(_Args):
    """The fields of `metadata.base.GetRequest` (whose own checks still run: one batch size, ...)."""

    consumer: str
    consumer_id: Annotated[str, msgspec.Meta(max_length=1024)]
    num_groups: Count | None = None
    num_samples: Count | None = None
    group_size: Count | None = None
    fields: Annotated[list[str], msgspec.Meta(max_length=MAX_COUNT)] | None = None
    max_staleness: Int | None = None
    current_version: Int | None = None
    max_version: Int | None = None
    timeout: Seconds | None = 0.0
    allow_partial: bool = False
    lineage: Annotated[list[Annotated[list[Int], msgspec.Meta(min_length=2, max_length=2)]], msgspec.Meta(max_length=1024)] | None = None


class AckArgs(_Args):
    consumer: str
    uids: Uids
    client_id: ClientId


class NackArgs(_Args):
    consumer: str
    lease_id: str
    uids: Uids
    client_id: ClientId


RenewArgs = NackArgs


class DropArgs(_Args):
    consumer: str
    uids: Uids
    cause: str
    client_id: ClientId


class NoArgs(_Args):
    """`stats` and `info` take nothing."""


class HelloArgs(_Args):
    """`hello`: a client asks for its token; `name` (its consumer id) only labels the identity."""

    name: ClientId


class Hello(msgspec.Struct):
    """The `hello` reply: the token to send as `client_id` / `consumer_id` from now on. Only this
    connection saw it (CURVE encrypts it), so no other client can act as this one."""

    token: str


class Info(msgspec.Struct):
    """The `info` reply: how a client reaches this run's plane."""

    storage: str
    storage_address: str
    consumer_groups: list[str]
    capacity: int


class Request(msgspec.Struct, forbid_unknown_fields=True):
    id: Int
    op: str
    args: msgspec.Raw
    """Decoded by `ARGS[op]` once the op is known."""


class Reply(msgspec.Struct, omit_defaults=True):
    id: int
    ok: bool
    result: Any = None
    error: str = ""
    kind: str = ""
    """The error's type name (`WireError`, `PermissionError`, `BusyError`, ...)."""


class RawReply(msgspec.Struct):
    """A reply as a client first reads it: `result` decoded by its op's decoder."""

    id: Any = None
    ok: bool = False
    result: msgspec.Raw = msgspec.Raw(b"\xc0")
    error: str = ""
    kind: str = ""


ARGS: dict[str, msgspec.msgpack.Decoder] = {
    "put": decoder(PutArgs), "update": decoder(UpdateArgs), "get": decoder(GetArgs), "ack": decoder(AckArgs),
    "nack": decoder(NackArgs), "drop": decoder(DropArgs), "renew": decoder(RenewArgs), "stats": decoder(NoArgs),
    "info": decoder(NoArgs), "hello": decoder(HelloArgs)}
RESULTS: dict[str, msgspec.msgpack.Decoder] = {
    "put": decoder(None), "update": decoder(None), "get": decoder(Batch), "ack": decoder(int),
    "nack": decoder(int), "drop": decoder(int), "renew": decoder(bool), "stats": decoder(QueueStats),
    "info": decoder(Info), "hello": decoder(Hello)}
request_decoder = decoder(Request)
reply_decoder = decoder(RawReply)
