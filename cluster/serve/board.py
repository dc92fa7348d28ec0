"""The replicas' latest published stats in this process, written by the engine replicas'
routers (``cluster.serve.router``) and read by the ingress (/metrics, GetServerInfo,
health). A module of its own: Serve may ship the router class by value, and a module is
always shipped by name, so both sides reach the same dict through it."""

from __future__ import annotations

# Replica id -> its latest published stats.
STATS: dict[str, dict] = {}


def publish(replica_id: str, stats: dict) -> None:
    STATS[replica_id] = stats


def keep_only(replica_ids: set[str]) -> None:
    for gone in set(STATS) - replica_ids:
        del STATS[gone]


def latest_stats() -> dict[str, dict]:
    return dict(STATS)


def hash_block_size() -> int | None:
    """The replicas' hash block size (they share one plan), once any has reported."""
    # list(): a copy made in one step, as another thread may publish meanwhile.
    return next((stats["hash_block_size"] for stats in list(STATS.values())), None)
