"""`Membership`: the one owner of the weight plane's asynchronous rules.

Rules it owns (and nothing else decides them):
- versions only grow: a publish must carry a version above the last one, and a receiver
  is only ever sent the current version;
- who takes part in an update: receivers joined *before* it starts; one that joins during
  an update waits for the next publish or `Sender.sync()` (late join);
- eviction: a receiver that does not acknowledge a bucket within `timeout_s`, or refuses
  one (checksum), leaves the update in progress; the others go on. It stays known as
  *behind* and is re-synced by the next publish / `sync()` once it joins again;
- liveness: a receiver evicted for a *timeout* is a *suspect*; a Join from it is not enough
  to take part again: it must answer a probe first (`Sender._admit`: Join -> Probe -> Pong), so a
  peer that joins and then stays silent costs one timeout in all, not one per publish;
- newcomers: a receiver id that was not a member of the sender's first update and never
  completed one takes part in a publish only when the caller names it (`receivers=`) or when
  no established receiver is live (a fresh start); otherwise it is brought in by `Sender.sync()`. So a peer that joins under
  a fresh id before every publish (ids cost nothing; any holder of the secret can make them) never
  stalls a publish; it may cost a `sync()` one timeout per id.

Example trace (timeout 2 s):

    t=0.0  join r0 (v=-1), join r1 (v=-1)      members {r0,r1}, both behind
    t=0.1  publish v=1 -> update {r0,r1}
    t=0.4  r1 killed; bucket 3 acked by r0 only
    t=2.4  r1 evicted (timeout); r0 finishes     r0@1, r1 evicted -> behind
    t=5.0  r1' joins again (v=-1)               pending, behind
    t=5.1  sync() -> update {r1'} at v=1        r0@1, r1'@1
    t=6.0  publish v=1 again -> ValueError (versions only grow)

Liveness trace (timeout 2 s; r2's process is up but its engine thread is stuck, so it reads nothing):

    t=0.0  publish v=2 -> update {r0,r1',r2}; r2 never acks ready
    t=2.0  r2 evicted (timeout) -> suspect       r0@2, r1'@2; publish returns after one timeout
    t=3.0  r2 joins again (say, a watchdog rebuilt its Receiver) -> sender sends Probe(n); no Pong
    t=4.0  publish v=3 -> update {r0,r1'}        r2 is not waited for: 0 s lost
    t=9.0  r2's loop reads again, answers Pong(n) -> live, behind; sync() brings it to v=3
"""

from __future__ import annotations

from dataclasses import dataclass, field

DISCONNECTED = "disconnected"
"""The eviction reason of a member no connection held at two liveness looks in a row (its process is
likely gone): what a caller probes before sending it anything again."""
TIMEOUT = "timeout"
"""The eviction reason of a member that did not answer a step within `timeout_s`."""
STRAGGLER = "straggler"
"""The eviction reason of a member still silent `straggler_s` after half of the others answered."""
SILENT = (DISCONNECTED, TIMEOUT, STRAGGLER)
"""Reasons that say nothing was heard from the member: it may be dead or hung, so a caller asks its
process (a health probe) before a sync that would wait for it."""


@dataclass
class ReceiverState:
    receiver_id: str
    version: int = -1
    """Last version this receiver acknowledged in full (-1: none)."""
    alive: bool = True
    """False once evicted, until it joins again."""
    suspect: bool = False
    """Evicted for a timeout: a Join must be followed by an answered probe to make it live."""


@dataclass
class UpdateOutcome:
    """What one `publish` / `sync` did; returned to the caller and kept for `stats`."""

    version: int
    completed: list[str] = field(default_factory=list)
    """Receivers that now hold `version`."""
    evicted: dict[str, str] = field(default_factory=dict)
    """Receiver id -> reason (`timeout`, `checksum`, `DISCONNECTED`, ...)."""
    seconds: float = 0.0
    bytes: int = 0
    """State-dict bytes sent (once; each receiver got all of them)."""
    buckets: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Membership:
    """Receivers known to a sender, their versions, and the current version."""

    def __init__(self) -> None:
        self.receivers: dict[str, ReceiverState] = {}
        self.version = -1
        self.established: set[str] = set()
        """Receiver ids that were members of the sender's first update or completed one since (kept
        across evictions and re-joins)."""

    def join(self, receiver_id: str, version: int) -> None:
        """(Re)admit a receiver; it is behind until it acknowledges the current version."""
        self.receivers[receiver_id] = ReceiverState(receiver_id, version, alive=True)

    def check_next(self, version: int) -> None:
        if version <= self.version:
            raise ValueError(
                f"publish version {version} must exceed the last published version {self.version}")

    def live(self) -> list[str]:
        return sorted(r for r, s in self.receivers.items() if s.alive)

    def behind(self) -> list[str]:
        """Live receivers that do not hold the current version."""
        return [r for r in self.live() if self.receivers[r].version < self.version]

    def evict(self, receiver_id: str, reason: str = "") -> None:
        state = self.receivers[receiver_id]
        state.alive = False
        state.suspect = state.suspect or reason in (TIMEOUT, STRAGGLER)

    def is_suspect(self, receiver_id: str) -> bool:
        state = self.receivers.get(receiver_id)
        return state is not None and state.suspect

    def complete(self, receiver_id: str, version: int) -> None:
        self.receivers[receiver_id].version = version
        self.established.add(receiver_id)

    def start(self, members: list[str]) -> None:
        """An update begins with `members`: the first one's members are established."""
        if not self.established:
            self.established.update(members)

    def publishable(self) -> list[str]:
        """Live receivers a publish that names none takes: the established ones, or every live one
        when none of those is (before the first update, or after all of them left)."""
        live = self.live()
        return [r for r in live if r in self.established] or live

    def newcomers(self) -> list[str]:
        """Live receivers an unnamed publish leaves for `sync()`."""
        return sorted(set(self.live()) - set(self.publishable()))

    def commit(self, version: int) -> None:
        self.version = max(self.version, version)

    def suspects(self) -> list[str]:
        return sorted(r for r, s in self.receivers.items() if s.suspect)

    def evicted(self) -> list[str]:
        return sorted(r for r, s in self.receivers.items() if not s.alive)
