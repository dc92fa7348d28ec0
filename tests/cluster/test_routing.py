"""The routing policies on replicas described by hand: which cached prefix each replica
would give a request (full-attention prefixes, boundary-only states), and which replica each
policy picks, exactly."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from cluster.serve.routing import (
    BOUNDARY,
    PREFIX,
    GroupHashes,
    ReplicaView,
    RoutingPolicy,
    short_hash,
)
from kvcore import hash_token_ids

HASHES = list(range(100, 110))  # a request of ten hash blocks


def replica(name, *groups, in_flight=0, routed=(), serving=True):
    view = ReplicaView(name, list(groups), serving=serving, in_flight=in_flight)
    view.routed = {h: 0.0 for h in routed}
    return view


def prefix(*hashes, units=1):
    return GroupHashes(units, PREFIX, frozenset(hashes))


def boundary(*hashes, units=1):
    return GroupHashes(units, BOUNDARY, frozenset(hashes))


def test_a_full_attention_hit_is_the_leading_cached_blocks():
    assert replica("a", prefix(100, 101, 102, 104)).cached_units(HASHES) == 3
    assert replica("a", prefix(101, 102)).cached_units(HASHES) == 0
    # Blocks of two hash blocks: a block is cached under its last unit's hash.
    assert replica("a", prefix(101, 103, 105, units=2)).cached_units(HASHES) == 6
    # What was routed there since its last report counts too.
    assert replica("a", prefix(100), routed=[101, 102]).cached_units(HASHES) == 3


def test_a_state_group_caps_the_hit_at_its_last_cached_boundary():
    # Attention holds 7 blocks; a state every 4 blocks, kept at 4 (and at 8, past the hit).
    hybrid = replica("h", prefix(*HASHES[:7]), boundary(103, 107, units=4))
    assert hybrid.cached_units(HASHES) == 4
    assert replica("h", prefix(*HASHES[:7]), boundary(107, units=4)).cached_units(HASHES) == 0


def test_kv_aware_takes_the_longest_hit_unless_it_is_overloaded():
    policy = RoutingPolicy("kv-aware", imbalance_threshold=2)
    cold = replica("a", prefix())
    warm = replica("b", prefix(*HASHES[:5]), in_flight=2)
    assert [r.replica_id for r in policy.order([cold, warm], HASHES)] == ["b", "a"]
    warm.in_flight = 3  # three more than the idle replica: past the threshold
    assert policy.order([cold, warm], HASHES)[0] is cold


def test_with_no_hit_the_least_loaded_then_the_emptier_replica_takes_it():
    policy = RoutingPolicy("kv-aware")
    full = replica("a", prefix(1, 2, 3))
    empty = replica("b", prefix())
    busy = replica("c", prefix(), in_flight=1)
    assert policy.order([full, empty, busy], HASHES)[0] is empty
    assert policy.order([full, busy], HASHES)[0] is full  # idle beats busy


def test_replicas_that_stopped_serving_are_left_out():
    policy = RoutingPolicy("kv-aware")
    dead = replica("a", prefix(*HASHES), serving=False)
    alive = replica("b", prefix())
    assert policy.order([dead, alive], HASHES)[0] is alive


def test_round_robin_and_power_of_two():
    views = [replica(name, prefix()) for name in "abc"]
    turns = RoutingPolicy("round-robin")
    assert [turns.order(views, HASHES)[0].replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    views[0].in_flight, views[1].in_flight, views[2].in_flight = 5, 1, 3
    pairs = RoutingPolicy("power-of-two", rng=random.Random(0))
    chosen = {pairs.order(views, HASHES)[0].replica_id for _ in range(50)}
    assert "a" not in chosen  # the busiest never wins its pair
    idle = [replica(name, prefix()) for name in "ab"]
    ties = Counter(pairs.order(idle, HASHES)[0].replica_id for _ in range(200))
    assert set(ties) == {"a", "b"} and min(ties.values()) > 60, ties  # a tie: either
    with pytest.raises(ValueError, match="Unknown routing policy"):
        RoutingPolicy("sticky")


def test_short_hashes_are_the_ones_kvcore_makes():
    salted = [short_hash(h) for h in hash_token_ids(list(range(40)), 16, "tenant")]
    plain = [short_hash(h) for h in hash_token_ids(list(range(40)), 16)]
    assert len(plain) == 2 and not set(plain) & set(salted)
