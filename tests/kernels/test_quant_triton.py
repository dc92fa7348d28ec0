"""The GPU's GGUF matmul (``kernels.quant.triton_matmul``) against products with the dequantized
weight, for every type kvray serves quantized, at decode and prefill row counts, on row slices
(TP shards) and column slices (row-parallel shards) of a matrix; under the Triton interpreter
here, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.quant.gguf_blocks import Q4, Q8, QuantizedMatrix
from kernels.quant.triton_matmul import ROW_TILES, quantized_linear, row_tile
from tests.kernels.test_quant_matmul import TYPES, gguf_matrix


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("num_rows", [1, 17, 70])  # tiles of 16, 32 and 64 (two of them)
def test_products_equal_float64_with_the_dequantized_weight(type_name, num_rows):
    # 75 features: one whole tile of 64 and a partial one; 160 columns: five blocks, the K
    # loop's last step half full.
    matrix, weight = gguf_matrix(type_name, 75, 160, seed=num_rows)
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 160, generator=generator)
    bias = torch.randn(75, generator=generator)
    got = quantized_linear(x, matrix, bias)
    assert got.shape == (num_rows, 75) and got.dtype == torch.float32
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("type_name", TYPES)
def test_shards_of_a_matrix_are_read_through_their_strides(type_name):
    matrix, weight = gguf_matrix(type_name, 40, 256)
    rows, cols = matrix.narrow(0, 8, 24), matrix.narrow(1, 64, 128)
    x = torch.randn(3, 2, 384)[..., :256]  # leading dims, rows with a stride past their length
    torch.testing.assert_close(quantized_linear(x, rows), x @ weight[8:32].T, rtol=1e-5, atol=1e-4)
    part = x[..., 64:192]
    torch.testing.assert_close(
        quantized_linear(part, cols), part @ weight[:, 64:192].T, rtol=1e-5, atol=1e-4
    )


def test_half_precision_inputs_give_their_dtype():
    matrix, weight = gguf_matrix("Q4_1", 64, 96)
    x = torch.randn(5, 96)
    for dtype in (torch.bfloat16, torch.float16):
        got = quantized_linear(x.to(dtype), matrix)
        assert got.dtype == dtype
        expected = x.to(dtype).double() @ weight.double().T
        torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=5e-2)


def test_row_tiles_and_refusals():
    assert [row_tile(n) for n in (1, 16, 17, 32, 33, 4096)] == [16, 16, 32, 32, 64, 64]
    assert ROW_TILES[-1] == 64
    matrix, _ = gguf_matrix("Q8_0", 8, 32)
    with pytest.raises(ValueError, match=r"not torch\.int64"):
        quantized_linear(torch.zeros(1, 32, dtype=torch.int64), matrix)
    with pytest.raises(ValueError, match="inputs on meta"):
        quantized_linear(torch.zeros(1, 32, device="meta"), matrix)


def test_a_workers_blocks_are_made_on_its_device():
    """What a GPU worker's loader fills: every array of the blocks on the worker's device."""
    for kind in (Q4, Q8):
        blocks = QuantizedMatrix.zeros(kind, 8, 64, device="meta")
        assert {t.device.type for t in (blocks.qs, blocks.scales, blocks.mins)} == {"meta"}
