"""The errors the engine raises to its front ends. Each front end maps them to its own status
codes in one table (gRPC in ``cluster.server``)."""

from __future__ import annotations

from cluster.validation import InvalidRequestError


class OverloadedError(RuntimeError):
    """The waiting queue is full; retry later."""


class EngineUnavailableError(RuntimeError):
    """The engine is not taking requests now (rebuilding its workers, or draining before it
    exits), or lost the worker group while the request ran; retry later."""


class EngineDeadError(EngineUnavailableError):
    """The engine stopped serving for good (its workers could not be rebuilt)."""


class WorkerLostError(RuntimeError):
    """A worker died or failed a step; the engine cannot go on (it rebuilds the group)."""


class EngineInternalError(RuntimeError):
    """The engine failed while serving the request; the request is over, the engine goes on."""


__all__ = [
    "EngineDeadError",
    "EngineInternalError",
    "EngineUnavailableError",
    "InvalidRequestError",
    "OverloadedError",
    "WorkerLostError",
]
