"""The Ray actor that hosts one ``Worker``: a thin wrapper, so the worker stays testable
without Ray. Ray is imported only here, when an actor is actually made.

Every call that runs torch runs on one thread of the actor's own, the one the worker was built
on: Ray serves plain calls on the actor's main thread and a compiled graph's steps on a thread
of its own, and each thread that runs torch ops gets its own OpenMP team, whose idle threads
make OpenMP see more threads than cores and wake every parallel region from sleep (SmolLM2
decoded at 20 tok/s stepped on a second thread, 35 on the loading one, two cores).
"""

from __future__ import annotations

from workers.parallel import pick_rendezvous
from workers.step_channel import ChannelListener
from workers.torch_thread import TorchThread
from workers.worker import Worker, WorkerOptions


class WorkerActor(Worker):
    """A ``Worker`` plus what only makes sense inside a Ray actor."""

    def __init__(self, rank: int, options: WorkerOptions):
        self._torch_thread = TorchThread()
        self._run(super().__init__, rank, options)

    def _run(self, method, *args):
        return self._torch_thread.run(method, *args)

    def init_tp_group(self, init_method: str | None) -> int:
        return self._run(super().init_tp_group, init_method)

    def init_stage_groups(self, init_method: str) -> int:
        return self._run(super().init_stage_groups, init_method)

    def load_model(self) -> None:
        return self._run(super().load_model)

    def report_shards(self) -> bytes:
        return self._run(super().report_shards)

    def report_specs(self) -> bytes:
        return self._run(super().report_specs)

    def allocate_kv_cache(self, config_bytes: bytes) -> int:
        return self._run(super().allocate_kv_cache, config_bytes)

    def execute(self, plan_bytes: bytes) -> bytes:
        return self._run(super().execute, plan_bytes)

    def run_stage(self, plan_bytes: bytes, hidden=None, owed=()):
        return self._run(super().run_stage, plan_bytes, hidden, owed)

    def execute_stage(self, plan_bytes: bytes, hidden) -> bytes:
        return self._run(super().execute_stage, plan_bytes, hidden)

    def health(self) -> dict:
        return self._run(super().health)

    def shutdown(self) -> None:
        return self._run(super().shutdown)

    def open_step_channel(self, stage: bool = False) -> tuple[str, int, bytes]:
        """Listen for the owner's step channel (``workers.step_channel``): the host and port
        to connect to and the token to send first. Steps sent over it run on the torch
        thread like ``execute`` (``serve_stage``, a pipeline stage's frames, with ``stage``);
        a new channel replaces the old one."""
        import ray

        listener = ChannelListener(ray.util.get_node_ip_address())
        serve_step = super().serve_stage if stage else super().execute
        listener.accept_in_background(
            lambda conn: self._torch_thread.serve_channel(conn, serve_step)
        )
        host, port = listener.address
        return host, port, listener.token

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
