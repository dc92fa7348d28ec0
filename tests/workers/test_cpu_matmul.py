"""CPU linear layers with oneDNN-packed weights compute what ``F.linear`` computes, and a
CPU worker packs every projection of its model (keeping a tied embedding whole)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.layers.cpu_matmul import linear, pack_weight
from workers.worker import Worker, WorkerOptions


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_products_match_f_linear(num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(num_rows, 40, generator=generator)
    packed = pack_weight(weight)
    assert packed is not None
    expected = F.linear(x, weight, bias)
    assert torch.allclose(linear(x, weight, packed, bias), expected, rtol=1e-5, atol=1e-5)


def test_only_fp32_cpu_weights_are_packed():
    assert pack_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert pack_weight(torch.randn(8, 8, device="meta")) is None


def test_a_cpu_worker_packs_its_projections_and_keeps_tied_embeddings():
    worker = Worker(0, WorkerOptions(kv_cache_memory_bytes=8 << 20))
    worker.init_tp_group(None)
    worker.load_model()
    projections = [m for m in worker.model.modules() if hasattr(m, "packed_weight")]
    assert projections and all(m.packed_weight is not None for m in projections)
    embedding = worker.model.model.embed_tokens.weight
    assert embedding.numel() > 0  # the lookup table stays whole
