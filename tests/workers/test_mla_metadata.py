"""The MLA step metadata, on a worked batch: which requests expand, and exactly which rows,
lengths, block rows and cache slots each path gets."""

from __future__ import annotations

import torch

from kernels.attention.metadata import build_attention_metadata
from workers.kinds.mla_metadata import (
    LATENT_COST_RATIO,
    build_mla_metadata,
    expansion_threshold,
    select_expanded,
)
from workers.model_config import MLAConfig

BLOCK = 4
# A decode (1 new token, 6 in all), a fresh prompt of 5, a decode of 1 over 3 and a prefill
# chunk of 3 new tokens over 9 cached.
QUERY_LENS = [1, 5, 1, 3]
SEQ_LENS = [6, 5, 3, 12]
ROWS = torch.tensor([[7, 8, 0], [3, 4, 0], [9, 0, 0], [1, 2, 5]], dtype=torch.int32)


def build(budget: int):
    attention = build_attention_metadata(QUERY_LENS, SEQ_LENS, ROWS, BLOCK)
    return build_mla_metadata(attention, QUERY_LENS, SEQ_LENS, ROWS, "cpu", budget)


def test_prefills_expand_in_order_while_their_contexts_fit_the_budget():
    assert select_expanded(QUERY_LENS, SEQ_LENS, 100) == [1, 3]
    assert select_expanded(QUERY_LENS, SEQ_LENS, 16) == [1]  # 5 + 12 > 16
    # A context past what is left is skipped; a later one that fits still expands.
    assert select_expanded([1, 5, 1, 3], [6, 13, 3, 12], 12) == [3]
    assert select_expanded(QUERY_LENS, SEQ_LENS, 4) == []  # decodes never expand


def test_prefills_with_fewer_new_tokens_than_the_threshold_stay_latent():
    assert select_expanded(QUERY_LENS, SEQ_LENS, 100, min_query_len=4) == [1]  # 5 new, not 3
    assert select_expanded(QUERY_LENS, SEQ_LENS, 100, min_query_len=6) == []


def mla(latent: int, rope: int, nope: int, value: int) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=latent, q_lora_rank=None, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=value, rope_interleave=True, attention_bias=False,
    )  # fmt: skip


def test_the_threshold_is_where_expanding_costs_less():
    # DeepSeek-V3: expanding costs 512 * 256 per context token and head, and saves
    # 2.5 * (2 * 512 + 64) - (128 + 64 + 128) = 2400 per query: it pays from 55 queries on.
    assert LATENT_COST_RATIO == 2.5
    assert expansion_threshold(mla(512, 64, 128, 128)) == 55
    assert 54 * 2400 < 512 * 256 < 55 * 2400
    # The tiny test model (tests/workers/hf_models.py): chunks of 9 or more expand.
    assert expansion_threshold(mla(32, 6, 20, 14)) == 9
    # Where a latent query is no dearer than an expanded one, every prefill expands.
    assert expansion_threshold(mla(4, 2, 16, 16)) == 2


def test_the_expanded_context_is_every_cached_position_of_its_requests():
    metadata = build(budget=100)
    latent, expanded = metadata.latent, metadata.expanded
    assert latent.token_index.tolist() == [0, 6]  # the two decode tokens
    assert latent.seq_lens.tolist() == [6, 3]
    assert latent.block_table.tolist() == [[7, 8, 0], [9, 0, 0]]
    assert expanded.token_index.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    # Request 1's 5 positions in blocks 3, 4; request 3's 12 in blocks 1, 2, 5.
    first = [3 * 4 + p for p in range(4)] + [4 * 4]
    second = [b * 4 + p for b in (1, 2, 5) for p in range(4)]
    assert expanded.context_slots.tolist() == first + second
    # In the expansion, request 1 owns rows 0..4 and request 3 rows 5..16, blocks of one row.
    assert expanded.metadata.block_size == 1
    assert expanded.metadata.block_table[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert expanded.metadata.block_table[1, :12].tolist() == list(range(5, 17))
    assert expanded.metadata.seq_lens_cpu == (5, 12)
    assert expanded.metadata.query_start_loc_cpu == (0, 5, 8)


def test_a_prefill_past_the_budget_attends_one_latent_row_per_token():
    metadata = build(budget=5)
    latent = metadata.latent
    assert latent.token_index.tolist() == [0, 6, 7, 8, 9]
    # The chunk's tokens sit at positions 9, 10 and 11: each sees itself and those before.
    assert latent.seq_lens.tolist() == [6, 3, 10, 11, 12]
    assert latent.block_table.tolist() == [[7, 8, 0], [9, 0, 0]] + [[1, 2, 5]] * 3
    assert metadata.expanded.token_index.tolist() == [1, 2, 3, 4, 5]


def test_an_all_decode_step_takes_no_index():
    attention = build_attention_metadata([1, 1], [6, 3], ROWS[:2], BLOCK)
    metadata = build_mla_metadata(attention, [1, 1], [6, 3], ROWS[:2], "cpu", 100)
    assert metadata.expanded is None
    assert metadata.latent.token_index is None  # every token: no gather, no scatter
