"""Which engine replica a request goes to, by policy; plain Python, so it is tested exactly and
the Serve router (``cluster.serve.router``) only feeds it.

``kv-aware`` (the default) scores each replica by the prompt prefix it would find cached. A
replica publishes, every few tenths of a second, the block hashes its coordinator holds per
KV-cache group (``cluster.serve.replica.routing_stats``), and the router adds the hashes it
routed there since (the replica computes them as the request runs, before its next report).
The router hashes the request's tokens as kvcore does (per ``cache_salt``, in the replicas'
hash blocks) and counts, per group, how far the request would hit: contiguous blocks for full
attention, a block at the boundary for a group whose state lives only there (a Mamba state, a
sliding window), the smallest over groups being the hit. The replica with the longest hit takes
the request unless its requests in flight exceed the least loaded replica's by more than the
imbalance threshold; with no hit worth a block anywhere, the least loaded replica does, the one
holding fewer blocks on a tie, so new prefixes spread over the replicas' caches.
``round-robin`` takes the replicas in turn; ``power-of-two`` the less loaded of two at random.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("kv-aware", "round-robin", "power-of-two")
CHOSEN_TTL_S = 2.0  # a choice Serve never sent stops counting as load after this
PREFIX, BOUNDARY = "prefix", "boundary"  # how a group's blocks make a hit


def short_hash(block_hash: bytes) -> int:
    """The first 8 bytes of a block hash: what replicas publish and the router compares."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass(frozen=True)
class GroupHashes:
    """One KV-cache group's cached blocks, as a replica publishes them."""

    units: int  # hash blocks per block of this group
    hit: str  # PREFIX (every block up to the hit) or BOUNDARY (the block at the hit)
    hashes: frozenset[int]


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    replica_id: str
    groups: list[GroupHashes] = field(default_factory=list)
    serving: bool = True
    in_flight: int = 0  # requests sent there and not yet completed
    # When requests were chosen for it that Serve has not sent yet (routing runs concurrently:
    # the next choice must see them).
    chosen: list[float] = field(default_factory=list)
    routed: dict[int, float] = field(default_factory=dict)  # hash -> when it was routed there
    # Every group's published hashes together, made once per report (not once per request).
    published: frozenset[int] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        self.set_groups(self.groups)

    def set_groups(self, groups: list[GroupHashes]) -> None:
        """The replica's latest report of what it caches."""
        self.groups = groups
        self.published = frozenset().union(*(g.hashes for g in groups))

    @property
    def load(self) -> int:
        recent = now() - CHOSEN_TTL_S
        self.chosen = [t for t in self.chosen if t >= recent]
        return self.in_flight + len(self.chosen)

    def forget_routed_before(self, when: float) -> None:
        self.routed = {h: t for h, t in self.routed.items() if t >= when}

    @property
    def num_known_blocks(self) -> int:
        """Distinct blocks the replica holds or will, as far as the router knows."""
        return len(self.published) + sum(1 for h in self.routed if h not in self.published)

    def cached_units(self, hashes: Sequence[int]) -> int:
        """Hash blocks of ``hashes`` (the request's, in order) this replica would find cached."""
        if not hashes:
            return 0
        if not self.groups:
            return _leading(hashes, self.routed, 1)
        hit = len(hashes)
        for group in self.groups:
            if group.hit == PREFIX:
                hit = min(hit, _leading(hashes, _Either(group.hashes, self.routed), group.units))
        for group in self.groups:
            if group.hit == BOUNDARY:
                held = _Either(group.hashes, self.routed)
                hit = _last_boundary(hashes, held, group.units, hit)
        return hit


class _Either:
    """Membership in either of two collections, without building their union (a replica
    publishes up to its whole cache's hashes; a request looks up a few of them)."""

    __slots__ = ("first", "second")

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __contains__(self, item) -> bool:
        return item in self.first or item in self.second


def _leading(hashes: Sequence[int], present, units: int) -> int:
    """Hash blocks covered by the leading blocks of ``units`` hash blocks that are present."""
    covered = 0
    while covered + units <= len(hashes) and hashes[covered + units - 1] in present:
        covered += units
    return covered


def _last_boundary(hashes: Sequence[int], present, units: int, limit: int) -> int:
    """The furthest block boundary at most ``limit`` whose block is present (0: none)."""
    end = (limit // units) * units
    while end > 0 and hashes[end - 1] not in present:
        end -= units
    return end


@dataclass
class RoutingPolicy:
    name: str = "kv-aware"
    # kv-aware: the most requests in flight the best-cached replica may have beyond the least
    # loaded one's before the request goes to the least loaded instead.
    imbalance_threshold: int = 8
    rng: random.Random = field(default_factory=random.Random)
    _turn: int = 0

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"Unknown routing policy {self.name!r}; choose one of {POLICIES}")

    def order(self, replicas: Sequence[ReplicaView], hashes: Sequence[int]) -> list[ReplicaView]:
        """``replicas`` from the most preferred to the least, for a request of ``hashes``."""
        live = [r for r in replicas if r.serving] or list(replicas)
        by_load = sorted(live, key=lambda r: (r.load, r.num_known_blocks, r.replica_id))
        if self.name == "round-robin":
            ordered = sorted(live, key=lambda r: r.replica_id)
            self._turn += 1
            first = ordered[(self._turn - 1) % len(ordered)]
        elif self.name == "power-of-two":
            # A tie goes to the first drawn: idle replicas share the requests.
            pair = self.rng.sample(live, min(2, len(live)))
            first = min(pair, key=lambda r: r.load)
        else:
            first = self._best_cached(by_load, hashes)
        return [first, *(r for r in by_load if r is not first)]

    def _best_cached(self, by_load: list[ReplicaView], hashes: Sequence[int]) -> ReplicaView:
        least = by_load[0]
        scored = [(r.cached_units(hashes), -r.load, r) for r in by_load]
        units, _, best = max(scored, key=lambda s: (s[0], s[1]))
        if units == 0 or best.load - least.load > self.imbalance_threshold:
            return least
        return best


def now() -> float:
    return time.monotonic()
