"""The worker's block tables: rows per request, grown by deltas, gathered per step."""

from __future__ import annotations

import pytest
import torch

from workers.block_table import BlockTable


def test_rows_follow_additions_appends_and_removals():
    table = BlockTable(max_blocks_per_request=6, num_rows=2)
    table.add("a", [5, 6])
    table.add("b", [9])
    table.append("a", [7])
    table.append("b", [])
    assert table.rows(["b", "a"]).tolist() == [[9, 0, 0], [5, 6, 7]]
    assert table.rows(["b"]).tolist() == [[9]]  # cut to the longest of the asked rows
    table.remove("a")
    table.add("c", [1])  # takes a's row: what a left there must not show
    assert table.rows(["c"]).tolist() == [[1]]
    assert table.rows(["c", "b"]).dtype == torch.int32


def test_the_table_grows_past_its_first_rows_and_refuses_overlong_requests():
    table = BlockTable(max_blocks_per_request=2, num_rows=1)
    for index in range(5):
        table.add(f"r{index}", [index + 1])
    assert table.rows([f"r{i}" for i in range(5)]).flatten().tolist() == [1, 2, 3, 4, 5]
    table.append("r0", [10])
    with pytest.raises(ValueError, match="exceed the 2 a request of max_model_len can hold"):
        table.append("r0", [11])
    assert table.num_blocks("r0") == 2


def test_an_unchanged_step_gets_the_same_rows_and_any_change_new_ones():
    table = BlockTable(max_blocks_per_request=4, num_rows=2)
    table.add("a", [3])
    table.add("b", [5, 6])
    first = table.rows(["a", "b"])
    assert table.rows(["a", "b"]) is first  # the next decode step, no block added
    assert table.rows(["b", "a"]).tolist() == [[5, 6], [3, 0]]
    table.append("a", [7])
    assert table.rows(["a", "b"]).tolist() == [[3, 7], [5, 6]]
    table.remove("b")
    table.add("c", [9])  # takes b's row
    assert table.rows(["a", "c"]).tolist() == [[3, 7], [9, 0]]
    assert first.tolist() == [[3, 0], [5, 6]]  # a gathered table is never written into
