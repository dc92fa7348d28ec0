"""The engine the front ends see when replicas serve: the same surface as ``AsyncEngine``
(``prepare``, ``sampling_params``, ``generate``, ``abort``, ``tokenizer``, ``metrics``,
``is_serving``, ``drain``), over a Serve deployment of engine replicas. Requests are checked
and tokenized here, once (``Admission.admit``), so the router can hash their tokens; each one
then streams from the replica the router picked. A client that leaves cancels its stream,
which aborts the request on its replica.

Errors the replica raised come back as themselves (an invalid request stays one), and what
Serve raises maps to the engine's own: no replica taking requests is UNAVAILABLE, every
replica's queue full is RESOURCE_EXHAUSTED. A request a replica turned away as unavailable
before streaming anything (its engine had just died) is sent again, to another replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster.admission import Admission, AdmittedRequest
from cluster.engine import finish_or_abort
from cluster.errors import (
    EngineInternalError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
)
from cluster.http.errors import HANDLED
from cluster.serve.board import latest_stats
from cluster.serve.metrics import merge_metrics
from cluster.startup import max_model_len_for
from kvcore import encode
from workers.model_source import load_tokenizer_for
from workers.sampling import SamplingParams

# A request a replica answered as unavailable before it streamed anything is sent again this
# many times, this far apart: for up to 4 s, by when the router has had the replica's next
# report (every 0.5 s, app.ROUTING_STATS_PERIOD_S) or Serve has failed its health check (2 s).
RESEND_ATTEMPTS, RESEND_DELAY_S = 8, 0.5
SERVE_ERRORS = (RayTaskError, RayActorError, BackPressureError, DeploymentUnavailableError)


class ReplicaSet:
    def __init__(self, handle, config, model_config):
        self.tokenizer = load_tokenizer_for(config.model, model_config.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len_for(config, model_config)
        self.admission = Admission(
            self.tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self.admission.default_sampling = dict(model_config.default_sampling or {})
        self.handle = handle
        self.metrics = _MergedMetrics()
        self.draining_reason: str | None = None
        self._streams: dict[str, object] = {}  # request id -> its response stream

    # -- the engine's surface ----------------------------------------------------------------

    @property
    def is_serving(self) -> bool:
        stats = latest_stats().values()
        return self.draining_reason is None and any(s.get("serving") for s in stats)

    def sampling_params(self, fields: dict) -> SamplingParams:
        return self.admission.sampling_params(fields)

    async def prepare(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AdmittedRequest:
        if self.draining_reason is not None:
            raise EngineUnavailableError(self.draining_reason)
        return await self.admission.admit(prompt, sampling, request_id, cache_salt=cache_salt)

    async def generate(self, request: AdmittedRequest) -> AsyncIterator:
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already running.")
        stream = None
        try:
            for attempt in range(RESEND_ATTEMPTS + 1):
                stream = self.handle.options(stream=True).generate.remote(encode(request))
                self._streams[request_id] = stream
                started = False
                try:
                    async for output in stream:
                        started = True
                        yield output
                    return
                except SERVE_ERRORS as exc:
                    error = engine_error(exc)
                    resend = not started and isinstance(error, EngineUnavailableError)
                    if not resend or attempt == RESEND_ATTEMPTS:
                        raise error from None
                finally:
                    stream.cancel()  # a client that left: the replica aborts the request
                # The replica could not serve it (its engine died or drains, and the router
                # has not heard yet) and nothing was streamed: the request goes again, to
                # another replica once the router has the replica's next report. It stays
                # registered meanwhile, so an abort or a drain still finds it.
                await asyncio.sleep(RESEND_DELAY_S)
                if self._streams.get(request_id) is not stream:  # aborted while it waited
                    return
        finally:  # unless an abort took it already
            if stream is not None and self._streams.get(request_id) is stream:
                del self._streams[request_id]

    def abort(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.cancel()
        return True

    async def drain(self, timeout: float) -> int:
        """Take no new requests; let running ones finish for up to ``timeout`` seconds, then
        abort the rest. Returns how many were aborted."""
        self.draining_reason = "The server is shutting down; retry elsewhere."
        return await finish_or_abort(self._streams, self.abort, timeout)


def engine_error(exc: Exception) -> Exception:
    """What a front end answers for an error a replica or Serve raised."""
    if isinstance(exc, BackPressureError):
        return OverloadedError(f"Every replica's queue is full; retry later. ({exc})")
    if isinstance(exc, (DeploymentUnavailableError, RayActorError)):
        return EngineUnavailableError(f"No engine replica could take the request: {exc}")
    cause = getattr(exc, "cause", None)
    if isinstance(cause, HANDLED):
        return cause
    return EngineInternalError(f"The engine replica failed: {cause or exc!r}")


class _MergedMetrics:
    """Every replica's metrics, each series labelled with its replica, and their totals."""

    def render(self) -> bytes:
        texts = {replica: s.get("metrics", "") for replica, s in latest_stats().items()}
        return merge_metrics(texts).encode()
