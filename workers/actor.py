"""The Ray actor that hosts one ``Worker``: a thin wrapper, so the worker stays testable
without Ray. Ray is imported only here, when an actor is actually made."""

from __future__ import annotations

from workers.parallel import pick_rendezvous
from workers.worker import Worker, WorkerOptions


class WorkerActor(Worker):
    """A ``Worker`` plus what only makes sense inside a Ray actor."""

    def __init__(self, rank: int, options: WorkerOptions):
        super().__init__(rank, options)

    def rendezvous_address(self) -> str:
        """A free ``tcp://`` address on this actor's node, for rank 0 to host the TP group."""
        import ray

        return pick_rendezvous(ray.util.get_node_ip_address())

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def remote_worker_class(*, num_cpus: float = 1, num_gpus: float = 0):
    """``WorkerActor`` as a Ray actor class with the given resources per rank."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(WorkerActor)
