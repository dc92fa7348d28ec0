"""The MLA backend interface a DeepSeek-V2/V3 attention layer programs against.

Multi-head latent attention caches one vector per token: the normalised latent ``kv_c``
(``L = kv_lora_rank`` values) followed by the rotated rope key ``k_pe`` (``R =
qk_rope_head_dim`` values), shared by every query head. kvcore plans it as an
``MLAAttentionSpec`` (one head, ``head_size = L + R``, ``head_size_v = 0``), so a layer's
cache view is ``[B, 1, N, C]`` with ``C >= L + R``, any strides, last dim contiguous. A
``[B, N, C]`` view (upstream's shape) is accepted too.

Decode runs with absorbed weights: the model multiplies the nope query by ``W_UK`` so that it
lives in latent space, the kernel attends over the latent (keys ``[kv_c | k_pe]``, values
``kv_c``, a prefix of the same row), and the model multiplies the result by ``W_UV``.
Projections, RoPE and the norm stay in the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

DEFAULT_NUM_SPLITS = 4  # partitions of each request's context in decode, as vLLM's Triton MLA


class UnknownMLABackendError(ValueError):
    """An MLA backend name that is not registered."""


class MLABackend(ABC):
    """One way of running MLA's cache write and decode. Stateless: safe to share across layers."""

    name: ClassVar[str]

    @abstractmethod
    def write_latent(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store token t's ``[kv_c[t] (L) | k_pe[t] (R)]`` in the first ``L + R`` elements of
        its cell at ``slot_mapping[t]`` (``block_id * block_size + offset``, equally a slot of a
        kernel-block split view); -1 skips the token. kv_c ``[T, L]``, k_pe ``[T, R]``, any
        strides; values are cast to the cache's dtype. Nothing else in the cache changes."""

    @abstractmethod
    def decode(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        scale: float,
        num_splits: int = DEFAULT_NUM_SPLITS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per request over its paged latent context.

        q_latent ``[R, Hq, L]``: the nope query already multiplied by ``W_UK``. q_pe
        ``[R, Hq, Rd]``: the rotated rope query. block_table ``[R, W]`` int32 manager block ids
        of ``block_size`` tokens (rows contiguous, e.g. the decode rows of the step's table);
        seq_lens ``[R]`` int32 context tokens per request, the new token's latent already
        written. Per head:
        ``p = softmax((q_latent · kv_c + q_pe · k_pe) * scale)`` over positions
        ``0 .. seq_len - 1``, output ``Σ p · kv_c``.

        Returns ``[R, Hq, L]`` in q_latent's dtype (into ``out`` if given); a request with no
        context gets zeros. Math is fp32 (float64 for float64 inputs on the torch backend).
        num_splits: partitions of each context, computed by separate programs and merged by
        log-sum-exp, so one long request still fills the GPU (a hint; the torch backend
        computes each request whole).
        """


def as_latent_view(kv_cache: torch.Tensor, latent_size: int, rope_size: int) -> torch.Tensor:
    """The cache as ``[B, 1, N, C]`` (a view of the same memory), or a refusal that says why."""
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(1)  # [B, N, C] -> [B, 1, N, C]
    if kv_cache.dim() != 4:
        raise ValueError(
            f"The MLA cache view must be [B, 1, N, C] or [B, N, C], got shape "
            f"{tuple(kv_cache.shape)}."
        )
    if kv_cache.shape[1] < 1:
        raise ValueError("The MLA cache view has no head slot.")
    if kv_cache.shape[-1] < latent_size + rope_size:
        raise ValueError(
            f"The MLA cache view holds {kv_cache.shape[-1]} elements per token, fewer than the "
            f"latent ({latent_size}) + rope ({rope_size})."
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("The MLA cache view's last dim must be contiguous.")
    return kv_cache


def check_write_args(kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if kv_c.dim() != 2 or k_pe.dim() != 2:
        raise ValueError(
            f"kv_c must be [T, L] and k_pe [T, R], got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}."
        )
    if not kv_c.shape[0] == k_pe.shape[0] == slot_mapping.numel() or slot_mapping.dim() != 1:
        raise ValueError(
            f"kv_c {tuple(kv_c.shape)}, k_pe {tuple(k_pe.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must agree on tokens."
        )


def check_decode_args(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    out: torch.Tensor | None,
) -> None:
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_latent.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"q_latent must be [R, Hq, L] and q_pe [R, Hq, Rd] with the same R and Hq, got "
            f"{tuple(q_latent.shape)} and {tuple(q_pe.shape)}."
        )
    num_reqs = q_latent.shape[0]
    if seq_lens.shape != (num_reqs,) or block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"{num_reqs} requests need seq_lens [{num_reqs}] and block_table [{num_reqs}, W], "
            f"got {tuple(seq_lens.shape)} and {tuple(block_table.shape)}."
        )
    if not (block_table[:1].is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("block_table rows and seq_lens must be contiguous (a row slice is fine).")
    if num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}.")
    if out is not None and out.shape != q_latent.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q_latent.shape)}.")
