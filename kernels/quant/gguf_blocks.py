"""GGUF's 32-weight blocks held as three arrays a matmul kernel reads directly.

A GGUF file stores each block as one record (a float16 scale, for Q4_1 a float16 minimum,
then the integers). kvray splits the records into ``qs`` (the integers: two 4-bit weights per
byte, or one int8), ``scales`` and ``mins`` (float16, one per block), so a row of a matrix is
three contiguous runs and a slice of rows or of 32-column groups is a view. Q4_0's
``d * (q - 8)`` is held as Q4_1's ``d * q + m`` with ``m = -8 d`` (exact in float16), so one
4-bit kernel serves both.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32  # weights per block, in every type served quantized
Q4, Q8 = "q4", "q8"
# GGUF storage type -> (kind it is held as, bytes per block in the file).
GGUF_TYPES = {"Q4_0": (Q4, 18), "Q4_1": (Q4, 20), "Q8_0": (Q8, 34)}


class QuantizedMatrix:
    """A ``[rows, cols]`` weight in blocks of 32 along each row (``cols`` a multiple of 32)."""

    # _kernel_args: the CPU kernel's arguments for these blocks (kernels.quant.cpu_matmul).
    __slots__ = ("_kernel_args", "kind", "mins", "qs", "scales")

    def __init__(self, kind: str, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
        self.kind = kind
        self.qs = qs  # [rows, cols / 2] uint8 (q4) or [rows, cols] int8 (q8)
        self.scales = scales  # [rows, cols / 32] float16
        self.mins = mins  # [rows, cols / 32] float16; [rows, 0] for q8
        self._kernel_args = None

    @classmethod
    def zeros(cls, kind: str, rows: int, cols: int, device="cpu") -> QuantizedMatrix:
        """All weights zero (scale 0) on ``device``: a slice no checkpoint fills, such as
        vocabulary padding, multiplies as zeros."""
        if cols % BLOCK:
            raise ValueError(f"{cols} columns do not split into blocks of {BLOCK}")
        blocks = cols // BLOCK
        if kind == Q4:
            qs = torch.zeros(rows, cols // 2, dtype=torch.uint8, device=device)
        elif kind == Q8:
            qs = torch.zeros(rows, cols, dtype=torch.int8, device=device)
        else:
            raise ValueError(f"Unknown quantized kind {kind!r}")
        halves = dict(dtype=torch.float16, device=device)
        mins = torch.zeros(rows, blocks if kind == Q4 else 0, **halves)
        return cls(kind, qs, torch.zeros(rows, blocks, **halves), mins)

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray) -> QuantizedMatrix:
        """A GGUF tensor's bytes, ``[rows, blocks * bytes per block]`` as the gguf reader
        gives them, split into the three arrays (copies: the file map is read-only)."""
        kind, size = GGUF_TYPES[type_name]
        records = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
        rows, blocks = records.shape[:2]
        scales = records[..., 0:2].copy().view(np.float16).reshape(rows, blocks)
        if type_name == "Q4_1":
            mins = records[..., 2:4].copy().view(np.float16).reshape(rows, blocks)
            qs = records[..., 4:].reshape(rows, blocks * 16)
        elif type_name == "Q4_0":
            mins = scales * np.float16(-8)
            qs = records[..., 2:].reshape(rows, blocks * 16)
        else:
            mins = np.zeros((rows, 0), np.float16)
            qs = records[..., 2:].copy().view(np.int8).reshape(rows, blocks * 32)
        return cls(
            kind,
            torch.from_numpy(np.ascontiguousarray(qs)),
            torch.from_numpy(np.ascontiguousarray(scales)),
            torch.from_numpy(np.ascontiguousarray(mins)),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins))

    def narrow(self, dim: int, start: int, length: int) -> QuantizedMatrix:
        """Rows ``start:start + length`` (dim 0) or columns (dim 1, whole blocks only), as
        views."""
        if dim == 0:
            parts = (t.narrow(0, start, length) for t in (self.qs, self.scales, self.mins))
            return QuantizedMatrix(self.kind, *parts)
        if dim != 1:
            raise ValueError(f"A quantized matrix has 2 dimensions, not {dim + 1}")
        if start % BLOCK or length % BLOCK:
            raise ValueError(
                f"columns {start}:{start + length} cut GGUF blocks of {BLOCK} weights; serve "
                "this split with --quantization none"
            )
        per_byte = 2 if self.kind == Q4 else 1
        qs = self.qs.narrow(1, start // per_byte, length // per_byte)
        b0, nb = start // BLOCK, length // BLOCK
        mins = self.mins.narrow(1, b0, nb) if self.kind == Q4 else self.mins
        return QuantizedMatrix(self.kind, qs, self.scales.narrow(1, b0, nb), mins)

    def index_rows(self, index: torch.Tensor) -> QuantizedMatrix:
        parts = (t.index_select(0, index) for t in (self.qs, self.scales, self.mins))
        return QuantizedMatrix(self.kind, *parts)

    def copy_(self, source) -> QuantizedMatrix:
        if not isinstance(source, QuantizedMatrix):
            raise ValueError("this weight is kept quantized; the checkpoint tensor is not")
        if source.kind != self.kind or source.shape != self.shape:
            raise ValueError(
                f"quantized tensor {source.kind} {source.shape} does not fit {self.kind} "
                f"{self.shape}"
            )
        for mine, theirs in zip(
            (self.qs, self.scales, self.mins), (source.qs, source.scales, source.mins), strict=True
        ):
            mine.copy_(theirs)
        return self

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (torch ops: the reference the kernel is checked against)."""
        rows, cols = self.shape
        scales = self.scales.float().unsqueeze(-1)  # [rows, blocks, 1]
        if self.kind == Q4:
            packed = self.qs.reshape(rows, -1, BLOCK // 2)
            q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
            weight = scales * q + self.mins.float().unsqueeze(-1)
        else:
            weight = scales * self.qs.reshape(rows, -1, BLOCK).float()
        return weight.reshape(rows, cols)
