"""The Mamba-2 mixer: in_proj -> [z | xBC | dt]; causal depthwise conv1d over xBC; the SSD scan
over (x, dt, B, C); gated RMSNorm ``norm(y * silu(z))`` grouped by ``n_groups``; out_proj.

Tensor parallelism splits the SSM heads (z, x, dt channels, A, D, dt_bias, the norm, out_proj's
input) across ranks. B and C come in ``n_groups`` groups: split when ``n_groups % tp == 0``, and
a single group is computed whole on every rank. A norm group that spans ranks (one group, TP > 1)
sums its squares over the TP group.

The layer's cache view is one raw page per block, ``[B, 1, 1, page bytes]``; binding it
(``kv_cache = view``) splits it into the conv state ``[B, K-1, conv_dim]`` in the model dtype
and the SSM state ``[B, H, P, N]`` (float32 by default), strided views of the same bytes. The
kernels come from the step's Mamba backend (``kernels.mamba``) and run through these views.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kernels.mamba import ConvWeights, MambaBackend, SSDParams
from kvcore.views import TORCH_DTYPES
from workers.forward_context import get_forward_context
from workers.kinds.mamba_metadata import MambaBatch, MambaMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear, _param, divide
from workers.model_config import MambaConfig
from workers.parallel import all_reduce, get_tp_group


class MambaShards:
    """Which rows of the checkpoint's ``in_proj`` and ``conv1d`` this rank holds."""

    def __init__(self, mamba: MambaConfig, tp_size: int, rank: int):
        self.num_heads = divide(mamba.num_heads, tp_size, "mamba_num_heads")
        self.num_groups = mamba.groups_per_rank(tp_size)
        self.intermediate = self.num_heads * mamba.head_dim  # I per rank
        self.bc = self.num_groups * mamba.state_size  # B (or C) channels per rank
        self.conv_dim = self.intermediate + 2 * self.bc
        inter, bc_full = mamba.intermediate_size, mamba.n_groups * mamba.state_size
        x = (rank * self.intermediate, self.intermediate)
        bc = (rank * self.bc, self.bc) if mamba.n_groups % tp_size == 0 else (0, bc_full)
        # (start, length) in the checkpoint, in this rank's order: x | B | C.
        self.conv_rows = [x, (inter + bc[0], bc[1]), (inter + bc_full + bc[0], bc[1])]
        # in_proj: z | x | B | C | dt, the xBC part shifted past z.
        xbc = [(inter + start, length) for start, length in self.conv_rows]
        dt = (2 * inter + 2 * bc_full + rank * self.num_heads, self.num_heads)
        self.in_proj_rows = [x, *xbc, dt]
        self.in_proj_size = 2 * inter + 2 * bc_full + mamba.num_heads
        self.full_conv_dim = inter + 2 * bc_full


def _load_rows(param: nn.Parameter, loaded, rows: list[tuple[int, int]], full: int) -> None:
    """Copy the checkpoint's ``rows`` (dim 0) into ``param``, back to back."""
    if loaded.shape[0] != full:
        raise ValueError(f"checkpoint tensor has {loaded.shape[0]} rows, expected {full}")
    parts = [loaded.narrow(0, start, length) for start, length in rows]
    param.data.copy_(torch.cat(parts).reshape(param.shape))


class MambaInProj(ColumnParallelLinear):
    """``in_proj``: this rank's z, x, B, C and dt rows of one checkpoint matrix."""

    def __init__(self, hidden_size: int, shards: MambaShards, *, bias: bool, dtype):
        nn.Module.__init__(self)  # the row layout below is the mixer's own
        self.shards = shards
        self.input_size = hidden_size
        self.output_size_per_rank = sum(length for _, length in shards.in_proj_rows)
        shape = (self.output_size_per_rank, hidden_size)
        self.weight = _param(shape, dtype, self.weight_loader)
        self.bias = _param(shape[:1], dtype, self.weight_loader) if bias else None
        self.packed_weight = None

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        _load_rows(param, loaded, self.shards.in_proj_rows, self.shards.in_proj_size)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))`` over groups of ``group_size`` channels, in float32."""

    def __init__(self, size_per_rank: int, group_size: int, eps: float, *, dtype):
        super().__init__()
        tp = get_tp_group()
        self.eps = eps
        self.group_size = group_size
        self.spans_ranks = group_size > size_per_rank  # one group over every rank's channels
        self.local_group_size = min(group_size, size_per_rank)
        self.weight = _param((size_per_rank,), dtype, self._loader(tp.rank, tp.world_size))
        self.weight.data.fill_(1.0)

    @staticmethod
    def _loader(rank: int, tp_size: int):
        def load(param: nn.Parameter, loaded) -> None:
            _load_rows(
                param, loaded, [(rank * param.shape[0], param.shape[0])], tp_size * param.shape[0]
            )

        return load

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        groups = gated.unflatten(-1, (-1, self.local_group_size))  # [T, I] -> [T, g, I/g]
        if self.spans_ranks:
            variance = all_reduce(groups.pow(2).sum(-1, keepdim=True)) / self.group_size
        else:
            variance = groups.pow(2).mean(-1, keepdim=True)
        normed = (groups * torch.rsqrt(variance + self.eps)).flatten(-2)  # [T, I]
        return self.weight * normed.to(y.dtype)


class MambaMixer2(nn.Module):
    def __init__(self, layer_name: str, hidden_size: int, mamba: MambaConfig, eps: float, dtype):
        super().__init__()
        tp = get_tp_group()
        shards = MambaShards(mamba, tp.world_size, tp.rank)
        self.layer_name = layer_name
        self.mamba = mamba
        self.shards = shards
        heads, head_start = shards.num_heads, tp.rank * shards.num_heads
        self.in_proj = MambaInProj(hidden_size, shards, bias=mamba.proj_bias, dtype=dtype)
        self.conv1d = nn.Module()
        conv_loader = self._conv_loader
        self.conv1d.weight = _param((shards.conv_dim, mamba.conv_kernel), dtype, conv_loader)
        if mamba.use_conv_bias:
            self.conv1d.bias = _param((shards.conv_dim,), dtype, conv_loader)
        else:
            self.conv1d.bias = None
        # A = -exp(A_log), kept in float32 (the checkpoint's A_log loads into it).
        self.A = _param((heads,), torch.float32, self._head_loader(head_start, negative_exp=True))
        self.D = _param((heads,), dtype, self._head_loader(head_start))
        self.dt_bias = _param((heads,), dtype, self._head_loader(head_start))
        group_size = mamba.intermediate_size // mamba.n_groups
        self.norm = GatedRMSNorm(shards.intermediate, group_size, eps, dtype=dtype)
        self.out_proj = RowParallelLinear(
            mamba.intermediate_size, hidden_size, bias=mamba.proj_bias, dtype=dtype
        )
        self.conv_state: torch.Tensor | None = None  # [B, K-1, conv_dim], bound with the cache
        self.ssm_state: torch.Tensor | None = None  # [B, H, P, N]
        self._kv_cache: torch.Tensor | None = None

    # -- weights ----------------------------------------------------------------------------

    def _conv_loader(self, param: nn.Parameter, loaded) -> None:
        _load_rows(param, loaded, self.shards.conv_rows, self.shards.full_conv_dim)

    @staticmethod
    def _head_loader(start: int, *, negative_exp: bool = False):
        def load(param: nn.Parameter, loaded) -> None:
            values = loaded.narrow(0, start, param.shape[0])
            param.data.copy_(-torch.exp(values.float()) if negative_exp else values)

        return load

    # -- cache ------------------------------------------------------------------------------

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, view: torch.Tensor | None) -> None:
        """Bind the layer's ``[B, 1, 1, page bytes]`` view (or unbind with None)."""
        self._kv_cache = view
        if view is None:
            self.conv_state = self.ssm_state = None
            return
        pages = view[:, 0, 0]  # [B, bytes]
        width, dim = self.mamba.conv_kernel - 1, self.shards.conv_dim
        conv_dtype, ssm_dtype = self.conv1d.weight.dtype, TORCH_DTYPES[self.mamba.ssm_cache_dtype]
        conv_bytes = width * dim * conv_dtype.itemsize
        ssm_shape = (self.shards.num_heads, self.mamba.head_dim, self.mamba.state_size)
        if conv_bytes % ssm_dtype.itemsize:
            raise ValueError(
                f"{self.layer_name}: the conv state ({conv_bytes} bytes) does not end on a "
                f"{ssm_dtype} boundary, where the SSM state starts."
            )
        ssm_bytes = ssm_shape[0] * ssm_shape[1] * ssm_shape[2] * ssm_dtype.itemsize
        if pages.shape[1] < conv_bytes + ssm_bytes:
            raise ValueError(f"{self.layer_name}: a page of {pages.shape[1]} bytes is too small")
        conv = pages[:, :conv_bytes].view(conv_dtype)  # [B, bytes] -> [B, (K-1) * D]
        self.conv_state = conv.unflatten(1, (width, dim))  # [B, K-1, D]
        ssm = pages[:, conv_bytes : conv_bytes + ssm_bytes].view(ssm_dtype)
        self.ssm_state = ssm.unflatten(1, ssm_shape)  # [B, H, P, N]

    def copy_states(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy whole states (conv and SSM) from block ``sources[i]`` to ``targets[i]``."""
        for state in (self.conv_state, self.ssm_state):
            state.index_copy_(0, targets, state.index_select(0, sources))

    # -- forward ----------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; reads and writes this layer's states."""
        step = get_forward_context().step_for(self.layer_name)
        metadata: MambaMetadata = step.metadata
        backend: MambaBackend = step.kernels
        if self.conv_state is None:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound (allocate it first)")
        shards, num_tokens = self.shards, hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split(
            [shards.intermediate, shards.conv_dim, shards.num_heads], dim=-1
        )
        xbc = self._conv(backend, xbc.contiguous(), metadata)  # [T, conv_dim]
        x, B, C = xbc.split([shards.intermediate, shards.bc, shards.bc], dim=-1)
        x = x.unflatten(-1, (shards.num_heads, self.mamba.head_dim))  # [T, H, P]
        B = B.unflatten(-1, (shards.num_groups, self.mamba.state_size))  # [T, G, N]
        C = C.unflatten(-1, (shards.num_groups, self.mamba.state_size))
        y = self._ssd(backend, x, dt.contiguous(), B, C, metadata)  # [T, H, P]
        y = self.norm(y.reshape(num_tokens, shards.intermediate), z)
        return self.out_proj(y)

    def _conv(self, backend: MambaBackend, xbc, metadata: MambaMetadata) -> torch.Tensor:
        conv, state = ConvWeights(self.conv1d.weight, self.conv1d.bias), self.conv_state
        out = None
        if metadata.decode is not None:
            batch = metadata.decode
            rows = backend.conv1d_decode(_rows(xbc, batch), conv, state, batch.state_indices)
            out = _put(out, xbc, batch, rows)
        if metadata.prefill is not None:
            batch = metadata.prefill
            rows = backend.conv1d_prefill(_rows(xbc, batch), conv, state, batch)
            out = _put(out, xbc, batch, rows)
        return out

    def _ssd(self, backend: MambaBackend, x, dt, B, C, metadata: MambaMetadata) -> torch.Tensor:
        out = None
        if metadata.decode is not None:
            batch = metadata.decode
            rows = backend.ssd_decode(
                *(_rows(t, batch) for t in (x, dt, B, C)),
                SSDParams(self.A, self.D, self.dt_bias),
                self.ssm_state,
                batch.state_indices,
            )
            out = _put(out, x, batch, rows)
        for batch in metadata.prefill_ssd_passes:
            if batch.chunks is None and batch.chunk_size is None:  # metadata built in tests
                batch = dataclasses.replace(batch, chunk_size=self.mamba.chunk_size)
            dt_min = self.mamba.dt_min if batch.is_prompt else 0.0
            rows = backend.ssd_prefill(
                *(_rows(t, batch) for t in (x, dt, B, C)),
                SSDParams(self.A, self.D, self.dt_bias, dt_min),
                self.ssm_state,
                batch,
            )
            out = _put(out, x, batch, rows)
        return out


def _rows(tensor: torch.Tensor, batch: MambaBatch) -> torch.Tensor:
    """The batch's rows of a step tensor."""
    return tensor if batch.token_index is None else tensor.index_select(0, batch.token_index)


def _put(out: torch.Tensor | None, like: torch.Tensor, batch: MambaBatch, rows: torch.Tensor):
    """Place the batch's output rows into the step's output (made on first use)."""
    if batch.token_index is None:
        return rows
    if out is None:
        out = like.new_empty((like.shape[0], *rows.shape[1:]))
    return out.index_copy_(0, batch.token_index, rows)
