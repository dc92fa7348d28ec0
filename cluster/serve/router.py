"""The Serve ``RequestRouter`` of the engine replicas: it keeps a ``ReplicaView`` per replica
from the stats each one publishes (``record_routing_stats``), counts the requests in flight on
each, remembers the blocks it routed where, and lets ``cluster.serve.routing`` order the
replicas for each request.

It runs in the process that holds the deployment handle (the ingress), which also reads the
replicas' latest stats, through ``cluster.serve.board``, for /metrics and GetServerInfo."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.admission import AdmittedRequest
from cluster.serve import board
from cluster.serve.routing import GroupHashes, ReplicaView, RoutingPolicy, now, short_hash
from kvcore import decode, hash_token_ids


class KVRayRouter(RequestRouter):
    def initialize_state(
        self, policy: str = "kv-aware", imbalance_threshold: int = 8, routed_ttl_s: float = 3.0
    ) -> None:
        self.policy = RoutingPolicy(policy, imbalance_threshold)
        # How long a block routed to a replica counts as held there before its stats say so.
        self.routed_ttl_s = routed_ttl_s
        self.views: dict[str, ReplicaView] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)

        views = {}
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            view = self.views.get(replica_id) or ReplicaView(replica_id)
            stats = replica.routing_stats or {}
            if stats:
                view.set_groups(
                    [
                        GroupHashes(g["units"], g["hit"], frozenset(g["hashes"]))
                        for g in stats["groups"]
                    ]
                )
                view.serving = stats["serving"]
                view.forget_routed_before(now() - self.routed_ttl_s)
                board.publish(replica_id, stats)
            views[replica_id] = view
        board.keep_only(set(views))
        self.views = views

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hashes = self._request_hashes(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self.views.get(i) or ReplicaView(i) for i in by_id]
        ordered = self.policy.order(views, hashes)
        first, chosen_at = ordered[0], now()
        first.chosen.append(chosen_at)
        # Its blocks will be there before its next report: count them held from now.
        first.routed.update(dict.fromkeys(hashes, chosen_at))
        return [[by_id[view.replica_id]] for view in ordered]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        view = self.views.get(replica_id.unique_id)
        if view is not None:
            view.in_flight += 1
            if view.chosen:
                view.chosen.pop(0)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        view = self.views.get(replica_id.unique_id)
        if view is not None:
            view.in_flight = max(0, view.in_flight - 1)

    def _request_hashes(self, pending_request: PendingRequest | None) -> list[int]:
        """The request's block hashes as the replicas' coordinators make them (empty for a
        call that carries no request)."""
        if pending_request is None or not pending_request.args:
            return []
        payload = pending_request.args[0]
        if not isinstance(payload, bytes):
            return []
        request = decode(payload, AdmittedRequest)
        block_size = board.hash_block_size()
        if block_size is None:
            return []
        blocks = hash_token_ids(request.token_ids, block_size, request.cache_salt)
        return [short_hash(h) for h in blocks]
