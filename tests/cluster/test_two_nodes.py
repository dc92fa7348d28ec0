"""Tensor-parallel ranks on two Ray nodes (``ray.cluster_utils.Cluster``) give the same tokens
as one in-process rank."""

from __future__ import annotations

import ray
from ray.cluster_utils import Cluster

from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.cluster.ray_helpers import BASE, greedy_tokens, serve, stop


def test_tp_ranks_on_different_nodes():
    with LocalServer(EngineConfig(**BASE)) as server:
        expected = greedy_tokens(server.address)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        cluster.wait_for_nodes()
        handle, address = serve(tensor_parallel_size=2, placement_strategy="STRICT_SPREAD")
        try:
            nodes = ray.get(handle.worker_node_ids.remote())
            assert len(set(nodes)) == 2
            assert greedy_tokens(address) == expected
        finally:
            stop(handle)
    finally:
        ray.shutdown()
        cluster.shutdown()
