"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
vocabulary (the last slice padded), so the embedding sums partial lookups over the group and
the head gathers partial logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.cpu_matmul import linear, pack_weight
from workers.layers.linear import weight_storage
from workers.parallel import all_gather_last_dim, all_reduce, get_tp_group


class VocabParallelEmbedding(nn.Module):
    holds_quantized = True  # its weight may be a QuantizedMatrix (workers.quantization)

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype):
        super().__init__()
        tp = get_tp_group()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.vocab_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.vocab_per_rank
        self.weight = nn.Parameter(
            torch.zeros(self.vocab_per_rank, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                f"{(self.vocab_size, self.hidden_size)}"
            )
        rows = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        weight_storage(param).narrow(0, 0, rows).copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_group().world_size == 1:
            return self._lookup(token_ids)
        local = token_ids - self.vocab_start
        is_mine = (local >= 0) & (local < self.vocab_per_rank)
        embedded = self._lookup(local.clamp(0, self.vocab_per_rank - 1))
        embedded = embedded * is_mine.unsqueeze(-1).to(embedded.dtype)
        return all_reduce(embedded)

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        quantized = getattr(self.weight, "quantized", None)
        if quantized is None:
            return F.embedding(rows, self.weight)
        flat = rows.reshape(-1)
        rows_read = quantized.index_rows(flat).dequantize().to(self.weight.dtype)
        return rows_read.reshape(*rows.shape, -1)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; shares its weight with the embedding when tied."""

    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> bool:
        """A packed copy for the logits (``workers.layers.cpu_matmul``); the weight itself
        stays, as the embedding may share it."""
        self.packed_weight = pack_weight(self.weight)
        return self.packed_weight is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [T, vocab_per_rank]
        logits = linear(hidden, self.weight, self.packed_weight, sampled_rows=True)
        logits = all_gather_last_dim(logits)  # [T, vocab_per_rank * tp]
        return logits[..., : self.vocab_size]
