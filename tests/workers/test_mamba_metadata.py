"""The per-step metadata of a Mamba group: who decodes, who prefills, where their tokens are,
and which dt floor each prefill token gets."""

from __future__ import annotations

import torch

from workers.kinds.mamba_metadata import build_mamba_metadata, state_slots


def ints(tensor):
    return None if tensor is None else tensor.tolist()


def test_decodes_and_prefills_are_split_by_kind():
    # r0 decodes an output; r1 prefills a lone prompt token; r2 its first chunk; r3 decodes.
    meta = build_mamba_metadata(
        query_lens=[1, 1, 4, 1],
        num_computed=[9, 5, 0, 3],
        num_prompt_tokens=[6, 6, 10, 2],
        slots=[11, 12, 13, 14],
    )
    assert ints(meta.decode.token_index) == [0, 6]
    assert ints(meta.decode.state_indices) == [11, 14]
    assert ints(meta.prefill.token_index) == [1, 2, 3, 4, 5]
    assert ints(meta.prefill.query_start_loc) == [0, 1, 5]
    assert ints(meta.prefill.has_initial_state) == [True, False]
    assert ints(meta.prefill.start_positions) == [5, 0]
    assert meta.prefill_ssd_passes == (meta.prefill,)


def test_one_kind_uses_every_token_in_order():
    meta = build_mamba_metadata([3, 2], [0, 4], [3, 9], [1, 2])
    assert meta.decode is None and meta.prefill.token_index is None
    meta = build_mamba_metadata([1, 1], [7, 4], [3, 2], [1, 2])
    assert meta.prefill is None and meta.decode.token_index is None


def test_recomputed_outputs_scan_in_a_second_pass_without_the_dt_floor():
    # A preempted request recomputes 3 prompt tokens and 2 outputs; another only outputs.
    meta = build_mamba_metadata([5, 3], [5, 12], [8, 10], [7, 8])
    prompt, rest = meta.prefill_ssd_passes
    assert prompt.is_prompt and not rest.is_prompt
    assert ints(prompt.token_index) == [0, 1, 2]
    assert ints(prompt.state_indices) == [7]
    assert ints(rest.token_index) == [3, 4, 5, 6, 7]
    assert ints(rest.query_start_loc) == [0, 2, 5]
    assert ints(rest.has_initial_state) == [True, True]
    assert ints(rest.start_positions) == [8, 12]
    assert ints(meta.prefill.token_index) is None  # the conv runs over whole chunks


def test_state_slot_is_the_first_block_of_the_group():
    assert state_slots(torch.tensor([[5, 0], [9, 0]], dtype=torch.int32)) == [5, 9]


def test_each_scan_pass_carries_its_chunk_table_for_every_layer():
    """The chunk table (a host sync on a GPU) is built once per step, not once per layer;
    the conv-only prefill batch of a two-pass step needs none."""
    one_pass = build_mamba_metadata([5, 1], [3, 9], [10, 6], [1, 2], chunk_size=4)
    (scan,) = one_pass.prefill_ssd_passes
    assert ints(scan.chunks.chunk_len) == [1, 4]  # 3 -> 4 on the 4-token grid, then 4 -> 8
    assert one_pass.decode.chunks is None
    two_pass = build_mamba_metadata([5], [1], [3], [7], chunk_size=4)
    assert two_pass.prefill.chunks is None
    # Prompt tokens 1-2, then outputs 3-5, which cross the grid at 4.
    assert [ints(p.chunks.chunk_len) for p in two_pass.prefill_ssd_passes] == [[2], [1, 2]]


def test_a_request_with_drafts_scans_one_token_a_chunk_and_keeps_each_draft_state():
    """r1 carries 2 drafts after its known token: the state after each of its tokens but the
    last goes to its draft blocks (31, 32), which needs every token to end a chunk; r2
    recomputes outputs in the usual chunks; r0 decodes plainly."""
    meta = build_mamba_metadata(
        query_lens=[1, 3, 3],
        num_computed=[9, 9, 7],
        num_prompt_tokens=[6, 6, 5],
        slots=[11, 12, 13],
        checkpoints=[[], [(1, 31), (2, 32)], []],
        chunk_size=4,
        num_drafts=[0, 2, 0],
    )
    assert ints(meta.decode.state_indices) == [11]
    assert ints(meta.prefill.state_indices) == [12, 13]  # the conv: both, checkpoints too
    assert ints(meta.prefill.checkpoints) == [[0, 1, 31], [0, 2, 32]]
    rest, drafted = meta.prefill_ssd_passes
    assert not rest.is_prompt and not drafted.is_prompt
    assert ints(rest.state_indices) == [13] and rest.chunk_size == 4
    assert ints(rest.chunks.chunk_len) == [1, 2]  # 7 -> 8 on the grid, then 8 -> 10
    assert ints(drafted.token_index) == [1, 2, 3]
    assert ints(drafted.state_indices) == [12] and drafted.chunk_size == 1
    assert ints(drafted.chunks.chunk_len) == [1, 1, 1]
    assert ints(drafted.chunks.checkpoint_chunk) == [0, 1]
    assert ints(drafted.chunks.checkpoint_slot) == [31, 32]
