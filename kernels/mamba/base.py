"""The Mamba-2 backend interface the NemotronH mixer programs against.

A mixer layer calls four operations: the causal depthwise conv1d and the SSD scan, each once
for the step's prefill requests (``*_prefill``, varlen) and once for its decode requests
(``*_decode``, one token each). Each takes the layer's tensors, its parameters as one struct
(``ConvWeights``, ``SSDParams``) and, for a varlen call, the requests as one struct
(``VarlenBatch``). Recurrent state lives in per-slot views of the cache buffer
(``conv_state [S, K-1, D]``, ``ssm_state [S, H, P, N]``, any strides, last dim contiguous);
every call reads a request's state from its slot and writes the new state back in place.
Gating, the grouped RMSNorm and the projections stay in the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.mamba.chunks import SSDChunks, build_ssd_chunks


class UnknownMambaBackendError(ValueError):
    """A Mamba backend name that is not registered."""


@dataclass(frozen=True)
class ConvWeights:
    """The causal conv1d's parameters: weight ``[D, K]``, bias ``[D]`` or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class SSDParams:
    """The scan's parameters: A ``[H]`` float32, negative (``-exp(A_log)``); D ``[H]``;
    dt_bias ``[H]``; dt is floored at ``dt_min`` after its softplus (0: no floor)."""

    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_min: float = 0.0


@dataclass(frozen=True)
class VarlenBatch:
    """The requests of one varlen call, back to back: request i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]`` of the step's tensors.

    state_indices ``[R]`` int32: each request's state slot. has_initial_state ``[R]`` bool:
    False treats the state as zeros and does not read it. query_start_loc ``[R+1]`` int32.
    start_positions ``[R]`` int32: tokens computed before this step (default zeros; the scan
    aligns its chunks to absolute positions, none crossing a multiple of ``chunk_size``).
    checkpoints: optional int32 ``[M, 3]`` rows ``(request r, tokens n of r's query consumed,
    slot s)``, n >= 1: also write the state after n tokens into slot s (for the scan, callers
    guarantee ``(start_positions[r] + n) % chunk_size == 0`` or n == r's query length).
    chunk_size: the scan's chunk, any power of two (the conv ignores it). chunks: the scan's
    chunk table (``kernels.mamba.chunks.build_ssd_chunks`` of these fields), when the caller
    runs several layers over one batch and builds it once; None builds it per call.
    """

    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc: torch.Tensor
    start_positions: torch.Tensor | None = None
    checkpoints: torch.Tensor | None = None
    chunk_size: int | None = None
    chunks: SSDChunks | None = None

    def ssd_chunks(self) -> SSDChunks:
        if self.chunks is not None:
            return self.chunks
        if self.chunk_size is None:
            raise ValueError("the SSD scan needs the batch's chunk_size")
        return build_ssd_chunks(
            self.query_start_loc, self.chunk_size, self.start_positions, self.checkpoints
        )


class MambaBackend(ABC):
    """One way of running the Mamba-2 mixer's kernels. Stateless: safe to share across layers."""

    name: ClassVar[str]

    @abstractmethod
    def conv1d_prefill(
        self, x: torch.Tensor, conv: ConvWeights, conv_state: torch.Tensor, batch: VarlenBatch
    ) -> torch.Tensor:
        """Causal depthwise conv1d + SiLU over a varlen batch.

        x ``[T, D]``: the requests' new tokens packed back to back. conv_state
        ``[S, K-1, D]``: per slot, the last K-1 inputs (oldest first) before this step; any
        strides (a view into a byte buffer), last dim contiguous.

        Returns ``silu(conv(x) + bias)`` ``[T, D]`` in x's dtype. Writes each request's final
        K-1 inputs into its slot (a request with fewer than K-1 new tokens takes the older part
        from its initial state, or zeros), and the K-1 inputs ending at each checkpoint into
        its slot.
        """

    @abstractmethod
    def conv1d_decode(
        self,
        x: torch.Tensor,
        conv: ConvWeights,
        conv_state: torch.Tensor,
        state_indices: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request: x ``[R, D]``. Shifts each slot's window by one (in place)
        and returns ``silu(conv + bias)`` ``[R, D]`` in x's dtype."""

    @abstractmethod
    def ssd_prefill(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        params: SSDParams,
        ssm_state: torch.Tensor,
        batch: VarlenBatch,
    ) -> torch.Tensor:
        """Mamba-2 SSD over a varlen batch.

        x ``[T, H, P]``; dt ``[T, H]`` raw (before dt_bias and softplus); B, C ``[T, G, N]``
        with ``H % G == 0`` (head h reads group ``h // (H // G)``). ssm_state
        ``[S, H, P, N]`` (any strides, last dim contiguous; float32, or bf16/fp16): the state
        before the step, read where has_initial_state. With
        ``dt' = max(softplus(dt + dt_bias), dt_min)``, per token:
        ``h = exp(dt' * A) * h + dt' * x ⊗ B``; ``y = h · C + D * x``.

        Math is float32 whatever the inputs' dtype; y comes back in x's dtype, the final state
        goes to the request's slot in ssm_state's dtype (and each checkpoint's to its slot).
        Prompts need not be multiples of the chunk size.
        """

    @abstractmethod
    def ssd_decode(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        params: SSDParams,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request (x ``[R, H, P]``, dt ``[R, H]``, B/C ``[R, G, N]``): the
        prefill recurrence for one step, the state read from and written back to its slot in
        place (math in float32). Returns y ``[R, H, P]`` in x's dtype."""
