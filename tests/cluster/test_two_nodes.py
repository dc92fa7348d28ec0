"""Tensor-parallel ranks, or pipeline stages, on two Ray nodes (``ray.cluster_utils.Cluster``)
give the same tokens as one in-process rank, and the controller, which serves gRPC, stays on
the node that started it (where the manifests' Service and readiness probe look for it)."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.cluster.ray_helpers import BASE, greedy_tokens, serve, stop


@ray.remote(num_cpus=1)
class Occupant:
    """Takes a node's only CPU. Ray then places actors that ask for no CPU (as the controller
    does) on other nodes, unless they are pinned."""

    def ready(self) -> bool:
        return True


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_ranks_on_different_nodes_and_the_server_on_the_starting_node(parallel):
    with LocalServer(EngineConfig(**BASE)) as server:
        expected = greedy_tokens(server.address)
    # The head (this driver's node) is busy; the two other nodes hold one rank each (a TP
    # rank, or a stage).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        cluster.wait_for_nodes()
        here = ray.get_runtime_context().get_node_id()
        pin_here = NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        occupant = Occupant.options(scheduling_strategy=pin_here).remote()
        ray.get(occupant.ready.remote())
        handle, address = serve(**parallel, placement_strategy="STRICT_SPREAD")
        try:
            assert ray.get(handle.node_id.remote()) == here
            nodes = ray.get(handle.worker_node_ids.remote())
            assert len(set(nodes)) == 2 and here not in nodes
            assert greedy_tokens(address) == expected
        finally:
            stop(handle)
    finally:
        ray.shutdown()
        cluster.shutdown()
