"""Column-, row- and QKV-parallel linear layers, and replicated ones.

Column-parallel layers split the output features across ranks and leave the output sharded;
row-parallel layers split the input features and sum the partial outputs over the TP group. A
column layer feeding a row layer therefore needs one all-reduce per pair. Each parameter has a
``weight_loader(param, full_tensor, shard_id=None)`` that takes this rank's slice of the
checkpoint tensor, so loading never materialises another rank's shard.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcore import kv_head_range, num_kv_heads_per_rank
from workers.layers.cpu_matmul import linear, pack_weight
from workers.parallel import all_reduce, get_tp_group


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor parallel size {denominator}"
        )
    return numerator // denominator


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def weight_storage(param: nn.Parameter):
    """Where a weight's values live: the parameter's tensor, or the ``QuantizedMatrix`` it
    holds instead when it is kept in GGUF blocks (``workers.quantization``). Both take
    ``narrow`` and ``copy_``, so one loader fills either."""
    return getattr(param, "quantized", None) or param.data


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows (output features) split across ranks."""

    holds_quantized = True  # its weight may be a QuantizedMatrix (workers.quantization)

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype):
        super().__init__()
        tp = get_tp_group()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, tp.world_size, "output features")
        shape = (self.output_size_per_rank, input_size)
        self.weight = _param(shape, dtype, self.weight_loader)
        self.bias = _param(shape[:1], dtype, self.weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None  # see pack_for_cpu

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows, cols = weight_storage(param).shape
        _check_shape(param, loaded, (self.output_size, cols))
        weight_storage(param).copy_(loaded.narrow(0, get_tp_group().rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed_weight, self.bias)

    def pack_for_cpu(self) -> bool:
        return _pack(self)


class ReplicatedLinear(ColumnParallelLinear):
    """The whole ``y = x W^T + b`` on every rank (a projection too small to split, or one every
    rank needs whole, such as MLA's latent)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.input_size = input_size
        self.output_size = self.output_size_per_rank = output_size
        self.weight = _param((output_size, input_size), dtype, self.weight_loader)
        self.bias = _param((output_size,), dtype, self.weight_loader) if bias else None
        self.packed_weight = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        storage = weight_storage(param)
        _check_shape(param, loaded, tuple(storage.shape))
        storage.copy_(loaded.narrow(0, 0, storage.shape[0]))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matrix (gate and up of an MLP); each rank
    holds its slice of every part, side by side."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool, dtype):
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        tp = get_tp_group()
        full = self.output_sizes[shard_id]
        size = divide(full, tp.world_size, "output features")
        offset = sum(self.output_sizes[:shard_id]) // tp.world_size
        storage = weight_storage(param)
        _check_shape(param, loaded, (full, *storage.shape[1:]))
        storage.narrow(0, offset, size).copy_(loaded.narrow(0, tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix. Query heads are split across ranks; KV heads are
    split when they divide, or replicated when there are fewer KV heads than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        dtype: torch.dtype,
    ):
        nn.Module.__init__(self)  # the column layout below is QKV's own
        tp = get_tp_group()
        self.head_size = head_size
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp.world_size, "num_attention_heads")
        self.num_kv_heads = num_kv_heads_per_rank(num_kv_heads, tp.world_size)
        self.kv_heads = kv_head_range(num_kv_heads, tp.world_size, tp.rank)
        self.input_size = hidden_size
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.output_size_per_rank = self.q_size + 2 * self.kv_size
        shape = (self.output_size_per_rank, hidden_size)
        self.weight = _param(shape, dtype, self.weight_loader)
        self.bias = _param(shape[:1], dtype, self.weight_loader) if bias else None
        self.packed_weight = None  # see pack_for_cpu (only fp32 weights are packed)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        tp = get_tp_group()
        if shard_id == "q":
            offset, size = 0, self.q_size
            start, full = tp.rank * self.q_size, self.total_num_heads * self.head_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            start, full = (
                self.kv_heads.start * self.head_size,
                self.total_num_kv_heads * self.head_size,
            )
        storage = weight_storage(param)
        _check_shape(param, loaded, (full, *storage.shape[1:]))
        storage.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's columns (input features) split across ranks; the partial
    products are summed over the group, and the bias is added once, after the sum."""

    holds_quantized = True

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.input_size = input_size
        self.input_size_per_rank = divide(input_size, get_tp_group().world_size, "input features")
        self.weight = _param((output_size, self.input_size_per_rank), dtype, self.weight_loader)
        self.bias = _param((output_size,), dtype, self.bias_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None  # see pack_for_cpu

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        storage = weight_storage(param)
        _check_shape(param, loaded, (storage.shape[0], self.input_size))
        start = get_tp_group().rank * self.input_size_per_rank
        storage.copy_(loaded.narrow(1, start, self.input_size_per_rank))

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_shape(param, loaded, tuple(param.shape))
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(linear(x, self.weight, self.packed_weight))
        return out if self.bias is None else out + self.bias

    def pack_for_cpu(self) -> bool:
        return _pack(self)


def _pack(layer: nn.Module) -> bool:
    """Swap the layer's weight for oneDNN's packed copy on CPUs (``workers.layers.cpu_matmul``),
    or for its quantized blocks where it is kept so; the unpacked weight is let go. False where
    it stays as it was."""
    packed = pack_weight(layer.weight)
    if packed is None:
        return False
    layer.packed_weight = packed
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)  # no second copy of the model
    return True
