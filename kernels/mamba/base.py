"""The Mamba-2 backend interface the NemotronH mixer programs against.

A mixer layer calls four operations: the causal depthwise conv1d and the SSD scan, each once
for the step's prefill requests (``*_prefill``, varlen) and once for its decode requests
(``*_decode``, one token each). Recurrent state lives in per-slot views of the cache buffer
(``conv_state [S, K-1, D]``, ``ssm_state [S, H, P, N]``, any strides, last dim contiguous);
every call reads a request's state from its slot and writes the new state back in place.
Gating, the grouped RMSNorm and the projections stay in the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kernels.mamba.chunks import SSDChunks


class UnknownMambaBackendError(ValueError):
    """A Mamba backend name that is not registered."""


class MambaBackend(ABC):
    """One way of running the Mamba-2 mixer's kernels. Stateless: safe to share across layers."""

    name: ClassVar[str]

    @abstractmethod
    def conv1d_prefill(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        state_indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        query_start_loc: torch.Tensor,
        checkpoints: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv1d + SiLU over a varlen batch.

        x ``[T, D]``: the requests' new tokens packed back to back; request i owns rows
        ``query_start_loc[i]:query_start_loc[i+1]``. weight ``[D, K]``; bias ``[D]`` or None.
        conv_state ``[S, K-1, D]``: per slot, the last K-1 inputs (oldest first) before this
        step; any strides (a view into a byte buffer), last dim contiguous. state_indices
        ``[R]`` int32: each request's slot. has_initial_state ``[R]`` bool: False treats the
        state as zeros and does not read it. query_start_loc ``[R+1]`` int32.

        Returns ``silu(conv(x) + bias)`` ``[T, D]`` in x's dtype. Writes each request's final
        K-1 inputs into its slot (a request with fewer than K-1 new tokens takes the older part
        from its initial state, or zeros). checkpoints: optional int32 ``[M, 3]`` rows
        ``(request r, tokens n of r's query consumed, slot s)``, n >= 1: also writes the K-1
        inputs ending after n tokens into slot s.
        """

    @abstractmethod
    def conv1d_decode(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
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
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        query_start_loc: torch.Tensor,
        chunk_size: int,
        dt_min: float = 0.0,
        start_positions: torch.Tensor | None = None,
        checkpoints: torch.Tensor | None = None,
        *,
        chunks: SSDChunks | None = None,
    ) -> torch.Tensor:
        """Mamba-2 SSD over a varlen batch.

        x ``[T, H, P]``; dt ``[T, H]`` raw (before dt_bias and softplus); A ``[H]`` float32,
        negative (``-exp(A_log)``); B, C ``[T, G, N]`` with ``H % G == 0`` (head h reads group
        ``h // (H // G)``); D ``[H]``; dt_bias ``[H]``. ssm_state ``[S, H, P, N]`` (any strides,
        last dim contiguous; float32, or bf16/fp16): the state before the step, read where
        has_initial_state. With ``dt' = max(softplus(dt + dt_bias), dt_min)``, per token:
        ``h = exp(dt' * A) * h + dt' * x ⊗ B``; ``y = h · C + D * x``.

        Math is float32 whatever the inputs' dtype; y comes back in x's dtype, the final state
        goes to the request's slot in ssm_state's dtype. chunk_size: any power of two; prompts
        need not be multiples of it. start_positions ``[R]`` int32 (tokens computed before this
        step; default zeros): chunks are aligned to absolute positions (none crosses a multiple
        of chunk_size), so checkpoints land on chunk boundaries. checkpoints: optional int32
        ``[M, 3]`` rows ``(request r, tokens consumed n, slot s)``: also write the state after
        n tokens into slot s; callers guarantee ``(start_positions[r] + n) % chunk_size == 0``
        or n == the request's query length. chunks: the batch's chunk table
        (``kernels.mamba.chunks.build_ssd_chunks`` of these arguments), when the caller runs
        several layers over one batch and builds it once; None builds it here.
        """

    @abstractmethod
    def ssd_decode(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        state_indices: torch.Tensor,
        dt_min: float = 0.0,
    ) -> torch.Tensor:
        """One token per request (x ``[R, H, P]``, dt ``[R, H]``, B/C ``[R, G, N]``): the
        prefill recurrence for one step, the state read from and written back to its slot in
        place (math in float32). Returns y ``[R, H, P]`` in x's dtype."""
