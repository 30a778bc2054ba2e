"""Authenticated records of the `redis` metadata backend: what a reader of Redis may believe.

Whoever can talk to the run's Redis (its password is not the run's secret) can rewrite any key, so
the producer-written content of every record carries a MAC that only holders of `queue.secret` can
compute, and every reader checks it before it decodes the record:

    key = HMAC-SHA256(secret, b"asyncrl tq redis record v1")
    tag = HMAC-SHA256(key, len|run_id, len|group_id, len|uid, blob)    (len: 4 bytes, big-endian)

`blob` is the record's msgpack `SampleMeta` (uid, group, version, meta with the reward, handles,
sealed), as `put` or `update` wrote it to `r:<uid>`; the tag lives beside it in `t:<uid>` of the
same group hash, so the Lua scripts, which never decode a blob, are unchanged by it. The run id,
group id and uid are the ones the record is stored under (the hash field, the stream entry's
group), so a valid blob and tag copied to another uid, group or run fail. A blob that verifies is
also checked to name the uid and group it is stored under.

Not covered: the state the scripts change on the server (leases, sealed flags, counts, `done`,
producers, memory ids, the stats counters), deletion (a Redis client can still drop or stall
records: a denial of service, not a forgery), and a rollback of a record to an earlier authentic
state of its own (the blob and tag it had before an `update`). With an empty secret (the package
used on its own, on a trusted host) no tags are written nor checked: records are not authenticated.

This module knows the framing of the scripts' replies (`redis_scripts.py`) and the MAC; it never
talks to Redis. Rejections are logged once per kind by each store (`ForgeryLog`); counting them is
the store's (`stats().forged`).
"""

from __future__ import annotations

import hmac
import logging
from typing import Iterator

import msgpack
import msgspec

from transfer_queue.records import SampleMeta, sample_decoder

log = logging.getLogger(__name__)

DOMAIN = b"asyncrl tq redis record v1"
Raw = tuple[bytes, bytes, bytes]
"""A record as a script returns it: (uid, tag, blob), each as stored (tag b"" where none is)."""


def _field(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return len(b).to_bytes(4, "big") + b


class RecordAuth:
    """Tags and checks the records of one run.

    Example:
        auth = RecordAuth(secret, run_id)
        tag = auth.tag("g1", "u1", blob)               # stored in t:u1 beside r:u1
        auth.open(b"g1", (b"u1", tag, blob))            # -> the SampleMeta; None if forged
    """

    def __init__(self, secret: str, run_id: str) -> None:
        self.enabled = bool(secret)
        """False with an empty secret: nothing is tagged or checked."""
        self._key = hmac.digest(secret.encode(), DOMAIN, "sha256")
        self._run = _field(run_id)

    def tag(self, gid: str | bytes, uid: str | bytes, blob: bytes) -> bytes:
        """The MAC of `blob` stored as record `uid` of group `gid` of this run (b"" without a secret)."""
        if not self.enabled:
            return b""
        return hmac.digest(self._key, b"".join((self._run, _field(gid), _field(uid), blob)), "sha256")

    def open(self, gid: bytes, raw: Raw) -> SampleMeta | None:
        """The record `raw` of group `gid` if this run wrote it there, else None (forged)."""
        uid, tag, blob = raw
        if not isinstance(blob, bytes) or not isinstance(tag, bytes):
            return None
        if self.enabled and not hmac.compare_digest(tag, self.tag(gid, uid, blob)):
            return None
        try:
            s = sample_decoder.decode(blob)
        except (msgspec.MsgspecError, ValueError):  # only reachable without a secret
            return None
        if s.uid.encode() != uid or s.group_id.encode() != gid:
            return None
        return s

    def open_group(self, gid: bytes, raws: list[Raw]) -> tuple[list[SampleMeta], int]:
        """The records of one group that verify, and how many did not."""
        out = [self.open(gid, r) for r in raws]
        good = [s for s in out if s is not None]
        return good, len(out) - len(good)


class ForgeryLog:
    """Logs the first rejection of each kind a store met, not every record of a flood."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, kind: str, n: int, detail: str) -> None:
        if n and kind not in self._seen:
            self._seen.add(kind)
            log.warning("redis queue: %d record(s) refused as forged (%s): %s; further ones are counted in "
                        "stats().forged, not logged", n, kind, detail)


def _stream(data: bytes) -> msgpack.Unpacker:
    """The objects of a msgpack stream a script concatenated (strings as bytes: blobs and tags are binary)."""
    it = msgpack.Unpacker(raw=True, max_buffer_size=max(len(data), 1))
    it.feed(data)
    return it


def entries(data: bytes) -> Iterator[tuple[str, bytes, list[Raw]]]:
    """READ's answer: per stream entry its id, its group id and its k records, each (uid, tag, blob)."""
    it = _stream(data)
    while it.tell() < len(data):
        eid, gid, k = it.unpack(), it.unpack(), it.unpack()
        yield eid.decode(), gid, [(it.unpack(), it.unpack(), it.unpack()) for _ in range(k)]


def freed(data: bytes) -> Iterator[tuple[bytes, Raw]]:
    """FINISH's freed records: per record its group id and (uid, tag, blob)."""
    it = _stream(data)
    while it.tell() < len(data):
        gid, uid, tag, blob = it.unpack(), it.unpack(), it.unpack(), it.unpack()
        yield gid, (uid, tag, blob)
