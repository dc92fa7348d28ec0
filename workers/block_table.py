"""The block tables of the requests a worker holds, one KV-cache group's per object.

Each request owns a row of one host tensor for as long as the worker holds it; a step's
deltas append to the rows, and the step's table is its requests' rows gathered in one
``index_select``. Nothing is rebuilt from Python lists each step, and a step whose requests
and blocks are the last step's (most decode steps: a block holds 16 tokens) gets the same
gathered table again. Readers must not write into it.
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, max_blocks_per_request: int, num_rows: int = 64):
        self.width = max(1, max_blocks_per_request)
        self._table = torch.zeros((num_rows, self.width), dtype=torch.int32, device="cpu")
        # The same memory through numpy: a row written from a list costs a microsecond there
        # and tens in a torch op (a decode step of 64 requests appends a few rows).
        self._cells = self._table.numpy()
        self._lens = [0] * num_rows  # blocks in each row
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._row_of: dict[str, int] = {}
        self._version = 0  # moves with every change to the table
        self._last_rows: tuple | None = None  # (request ids, version, their gathered rows)

    def add(self, request_id: str, block_ids: list[int]) -> None:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._version += 1
        self._row_of[request_id] = row
        self._lens[row] = 0
        self._cells[row] = 0  # a reused row: padding stays the null block
        self.append(request_id, block_ids)

    def append(self, request_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self._row_of[request_id]
        self._version += 1
        start = self._lens[row]
        if start + len(block_ids) > self.width:
            raise ValueError(
                f"Request {request_id}: {start + len(block_ids)} blocks exceed the "
                f"{self.width} a request of max_model_len can hold"
            )
        self._cells[row, start : start + len(block_ids)] = block_ids
        self._lens[row] = start + len(block_ids)

    def remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._version += 1
            self._free_rows.append(row)

    def num_blocks(self, request_id: str) -> int:
        return self._lens[self._row_of[request_id]]

    def rows(self, request_ids: list[str]) -> torch.Tensor:
        """``[len(request_ids), width]`` int32: each request's blocks, then zeros (the null
        block), cut to the longest of these requests."""
        last = self._last_rows
        if last is not None and last[1] == self._version and last[0] == request_ids:
            return last[2]
        rows = [self._row_of[r] for r in request_ids]
        width = max((self._lens[row] for row in rows), default=1)
        index = torch.tensor(rows, dtype=torch.int64, device="cpu")
        gathered = self._table[:, : max(width, 1)].index_select(0, index)
        self._last_rows = (list(request_ids), self._version, gathered)
        return gathered

    def _grow(self) -> None:
        old = self._table.shape[0]
        self._table = torch.cat([self._table, torch.zeros_like(self._table)])
        self._cells = self._table.numpy()
        self._lens += [0] * old
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
