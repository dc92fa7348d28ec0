"""GGUF blocks served quantized: the split arrays hold exactly what gguf's own dequantizer
reads from the file, and the C kernel's products equal float64 products with the dequantized
weights, for every type kvray serves quantized, at decode and prefill row counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.quant import cpu_matmul
from kernels.quant.cpu_matmul import KERNEL_MAX_ROWS, quantized_linear
from kernels.quant.gguf_blocks import GGUF_TYPES, QuantizedMatrix

TYPES = sorted(GGUF_TYPES)


def gguf_matrix(type_name: str, rows: int, cols: int, seed: int = 0):
    """A random weight quantized by gguf: (our matrix, gguf's dequantized float32)."""
    generator = np.random.default_rng(seed)
    weight = generator.standard_normal((rows, cols)).astype(np.float32)
    weight += generator.uniform(-1, 1, (rows, 1)).astype(np.float32)  # nonzero block minima
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(weight, qtype)
    expected = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).copy())
    return QuantizedMatrix.from_gguf(type_name, raw), expected


@pytest.fixture(autouse=True)
def needs_the_kernel():
    assert cpu_matmul.kernel() is not None, "the CPU quantized kernel did not build"


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_hold_what_gguf_reads(type_name):
    matrix, expected = gguf_matrix(type_name, 7, 96)
    assert matrix.shape == (7, 96)
    assert torch.equal(matrix.dequantize(), expected)
    assert torch.equal(cpu_matmul.dequantize(matrix), expected)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("num_rows", [*range(1, 10), KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 5])
def test_products_equal_float64_with_the_dequantized_weight(type_name, num_rows, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "INT16_MAX_ROWS", 0)  # the float path at every row count
    matrix, weight = gguf_matrix(type_name, 75, 160, seed=num_rows)  # odd rows: a lone last row
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 160, generator=generator)
    bias = torch.randn(75, generator=generator)
    expected = x.double() @ weight.double().T + bias.double()
    got = quantized_linear(x, matrix, bias)
    assert got.shape == (num_rows, 75) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def int16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the integer path holds it: per 32-value block, float32 ``16383 / max|x|`` times
    x rounded half to even, and the block scales ``max|x| / 16383``."""
    blocks = x.reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(16383.0) / largest, torch.zeros(()))
    return torch.round(blocks * inverse), largest / torch.tensor(16383.0)


@pytest.mark.skipif(not cpu_matmul.has_int16_path(), reason="the integer path needs AVX2")
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("cols", [288, 1120])
def test_the_integer_path_is_the_product_of_int16_activations(
    type_name, num_rows, cols, monkeypatch
):
    """On the integer path x is rounded to int16 per block: the products equal float64 ones
    of the rounded activations, and those of x itself within the rounding's bound (half a step
    per value times the weight's magnitude). One or two rows go one at a time (split into
    bytes with AVX-512 VNNI), more in tiles of four (5 rows: a tile and a lone row). 288
    columns are a group of eight blocks and one left over (split: 4-bit two groups of four and
    a lone block through masks, 8-bit four pairs and a lone block); 1120 are 35 blocks, past
    the sixteen blocks whose scales the split form makes at once (4-bit: a last group of
    three)."""
    monkeypatch.setattr(cpu_matmul, "INT16_MAX_ROWS", KERNEL_MAX_ROWS)
    matrix, weight = gguf_matrix(type_name, 75, cols, seed=7 + num_rows)
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows)) * 3
    assert cpu_matmul.matmul_function(num_rows) == cpu_matmul.kernel().gguf_matmul_int16
    got = quantized_linear(x, matrix).double()
    q, scales = int16_rows(x)
    rounded = (q.double() * scales.double()).reshape(x.shape)
    # A 4-bit block's minimum multiplies the float sum of x:
    # sum(x (d q + m)) = d sum(x q) + m sum(x)
    minimum = torch.zeros_like(weight, dtype=torch.float64)
    if matrix.kind == "q4":
        minimum = matrix.mins.double().repeat_interleave(32, dim=1)
    expected = rounded @ (weight.double() - minimum).T + x.double() @ minimum.T
    # float32 sums of the blocks' products: their rounding grows with the columns
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4 * cols / 288)
    exact = x.double() @ weight.double().T
    steps = scales.expand(-1, -1, 32).reshape(x.shape).double() / 2
    bound = steps @ (weight.double() - minimum).abs().T + 1e-4
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 0  # the rounding is there: this is not the float path


# The float tiles and the split form (where the CPU has VNNI) at every size: each is its own
# instantiation, a speculative verification's 5 rows among them.
SAME_ALONE = [
    pytest.param(0, 8, id="float-tiles"),
    pytest.param(
        cpu_matmul.split_max_rows(), cpu_matmul.split_max_rows(), id="split-form",
        marks=pytest.mark.skipif(
            cpu_matmul.split_max_rows() == 0, reason="the split form needs AVX-512 VNNI"
        ),
    ),
]  # fmt: skip


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("int16_max_rows,max_rows", SAME_ALONE)
def test_a_row_gets_the_product_it_gets_alone(type_name, int16_max_rows, max_rows, monkeypatch):
    """Rows that share W's bytes are each summed as alone: a decode step of several requests
    multiplies each as a step of one would, bit for bit."""
    if int16_max_rows is not None:
        monkeypatch.setattr(cpu_matmul, "INT16_MAX_ROWS", int16_max_rows)
    matrix, _ = gguf_matrix(type_name, 75, 1120, seed=3)
    x = torch.randn(max_rows, 1120, generator=torch.Generator().manual_seed(4)) * 3
    alone = torch.cat([quantized_linear(x[i : i + 1], matrix) for i in range(max_rows)])
    for rows in range(2, max_rows + 1):
        assert torch.equal(quantized_linear(x[:rows], matrix), alone[:rows]), rows


def test_the_split_byte_form_is_there_on_cpus_with_avx512_vnni():
    """The integer path takes vpdpbusd for up to 6 rows where the CPU has it (decode steps'
    one or two, an LM head's all six; the products above then come from that form);
    elsewhere the vpmaddwd form serves them."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    has_vnni = {"avx512_vnni", "avx512bw", "avx512vl", "f16c"} <= set(flags.split())
    assert cpu_matmul.split_max_rows() == (6 if has_vnni else 0)
    assert cpu_matmul.logits_int16_max_rows() == (6 if has_vnni else cpu_matmul.int16_max_rows())


def test_leading_dimensions_and_strided_rows_are_kept(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "INT16_MAX_ROWS", 0)  # float32 exactness below
    matrix, weight = gguf_matrix("Q4_1", 33, 64)
    x = torch.randn(2, 3, 128)[..., :64]  # rows with a stride past their length
    torch.testing.assert_close(quantized_linear(x, matrix), x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("type_name", TYPES)
def test_narrowed_rows_and_block_columns_are_the_same_slices(type_name, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "INT16_MAX_ROWS", 0)  # float32 exactness below
    matrix, weight = gguf_matrix(type_name, 12, 128)
    rows = matrix.narrow(0, 3, 5)
    torch.testing.assert_close(rows.dequantize(), weight[3:8], rtol=0, atol=0)
    cols = matrix.narrow(1, 32, 64)
    torch.testing.assert_close(cols.dequantize(), weight[:, 32:96], rtol=0, atol=0)
    into = QuantizedMatrix.zeros(matrix.kind, 12, 64)
    into.copy_(cols)  # what a row-parallel loader does with its slice
    x = torch.randn(2, 64)
    torch.testing.assert_close(quantized_linear(x, into), x @ weight[:, 32:96].T)


def test_a_column_slice_that_cuts_a_block_is_refused():
    matrix, _ = gguf_matrix("Q8_0", 4, 128)
    with pytest.raises(ValueError, match=r"cut GGUF blocks.*--quantization none"):
        matrix.narrow(1, 16, 64)


def test_a_float_tensor_cannot_fill_a_quantized_weight():
    with pytest.raises(ValueError, match="kept quantized"):
        QuantizedMatrix.zeros("q4", 4, 32).copy_(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="does not fit"):
        QuantizedMatrix.zeros("q4", 4, 32).copy_(QuantizedMatrix.zeros("q8", 4, 32))


def test_only_float32_cpu_inputs_are_taken():
    matrix, _ = gguf_matrix("Q4_0", 4, 32)
    with pytest.raises(ValueError, match="float32 CPU inputs"):
        quantized_linear(torch.randn(1, 32, dtype=torch.bfloat16), matrix)


def test_a_large_weight_stays_with_the_kernel_past_the_row_limit(monkeypatch):
    """Past KERNEL_MAX_ROWS a weight too large to expand each step is multiplied in blocks."""
    matrix, weight = gguf_matrix("Q4_1", 40, 64)
    monkeypatch.setattr(cpu_matmul, "EXPAND_MAX_VALUES", 40 * 64 - 1)
    monkeypatch.setattr(cpu_matmul, "dequantize", None)  # expanding would raise
    x = torch.randn(KERNEL_MAX_ROWS + 9, 64)
    torch.testing.assert_close(quantized_linear(x, matrix), x @ weight.T, rtol=1e-5, atol=1e-4)
