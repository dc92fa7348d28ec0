"""Every kernel variant the engine can launch compiles to a cubin for sm_80 and sm_90.

Without a GPU the kernel tests run under the Triton interpreter, which accepts things the
compiler refuses (non-constexpr globals, loop-carried type changes, dot shapes below 16) and
computes every product in fp32, so the bf16 and fp16 ``tl.dot`` a GPU runs are never built
there. This test closes that gap on any machine. One fresh process imports triton without the
interpreter and calls the real launchers with a recording stand-in for each kernel: the
compile-time settings are the launchers' own ``launch_constexprs``, the arguments the tensors and
scalars they pass. Each recorded launch then goes through triton's own launch path (``warmup``)
with a stand-in driver for Ampere and for Hopper, so triton types and specialises the arguments
as on a GPU (pointer dtypes, unit strides, 16-byte alignment; specialised loads are pipelined and
take up to 2.5x the shared memory) and compiles down to a cubin with the bundled ptxas. Each
cubin must also fit its arch's shared memory, or the launch would fail on the GPU.

The matrix (``VARIANTS``): attention in bf16, fp16 and fp32, each with a decode tile and a
prefill tile, with the window, softcap and sinks switches each on in some and off in others;
GQA, MQA, a head size that pads and a V head unlike K's; cache writes in the three dtypes. The
compiles share a process per CPU (compiling holds the GIL, so threads would not help). A variant
that fails is named with its error, a crash names the variants it hit, and the exact list of
names catches a variant that silently drops out.
"""

from __future__ import annotations

import functools
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

# Targets, and the most shared memory one block may use there (A100, H100).
ARCHS = {"sm_80": 80, "sm_90": 90}
MAX_SHARED_BYTES = {"sm_80": 166912, "sm_90": 232448}
DTYPES = ("bf16", "fp16", "fp32")
TILES = ("decode", "prefill")
FEATURES = ("window", "softcap", "sinks")
STARTED, FINISHED = "compiling", "compiled"  # the child's progress lines on stderr
# Each worker holds torch and triton (~0.4 GB); past 4, the slowest compile sets the pace.
MAX_WORKERS = 4


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int


GQA = Shape(32, 8, 128, 128)  # Llama-3-8B
MQA = Shape(8, 1, 256, 256)  # Gemma-2B: one KV head, the largest common head
PADDED = Shape(32, 32, 80, 80)  # Phi-2: 80 pads to 128, and no grouping
SPLIT_V = Shape(16, 2, 192, 128)  # K 192 (pads to 256), V 128: DeepSeek-V2's head sizes


@dataclass(frozen=True)
class Attention:
    dtype: str
    tile: str  # "decode": query_len 1; "prefill": max_query_len >= PREFILL_BLOCK_M
    shape: Shape
    features: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        s = self.shape
        heads = f"q{s.num_q_heads}:kv{s.num_kv_heads} d{s.head_size}/{s.head_size_v}"
        return f"attention {self.dtype} {self.tile} {heads} {'+'.join(self.features) or 'plain'}"


@dataclass(frozen=True)
class CacheWrite:
    dtype: str
    shape: Shape

    @property
    def name(self) -> str:
        s = self.shape
        return f"cache_write {self.dtype} kv{s.num_kv_heads} d{s.head_size}/{s.head_size_v}"


ALL = FEATURES
VARIANTS = [
    # Every dtype x tile; each switch is on in one tile of a dtype and off in the other.
    Attention("bf16", "decode", GQA, ALL),
    Attention("bf16", "prefill", GQA),
    Attention("fp16", "decode", GQA),
    Attention("fp16", "prefill", GQA, ALL),
    Attention("fp32", "decode", GQA, ("window",)),
    Attention("fp32", "prefill", GQA, ("softcap", "sinks")),
    # The other shapes, each meeting a switch.
    Attention("bf16", "decode", MQA, ("softcap",)),
    Attention("bf16", "prefill", MQA, ("window",)),
    Attention("fp16", "prefill", PADDED, ("window",)),
    Attention("bf16", "prefill", SPLIT_V, ("sinks",)),
    CacheWrite("bf16", GQA),
    CacheWrite("fp16", PADDED),
    CacheWrite("fp32", SPLIT_V),
    CacheWrite("bf16", MQA),  # one head per program (BLOCK_H 1)
]


def variant_names() -> list[str]:
    return [f"{arch} {v.name}" for v, arch in itertools.product(VARIANTS, ARCHS)]


def test_matrix_covers_every_dtype_tile_switch_and_shape():
    attention = [v for v in VARIANTS if isinstance(v, Attention)]
    assert {(v.dtype, v.tile) for v in attention} == set(itertools.product(DTYPES, TILES))
    for feature in FEATURES:
        switched = {(v.tile, feature in v.features) for v in attention}
        assert switched == set(itertools.product(TILES, (True, False))), feature
    shapes = {v.shape for v in attention}
    assert any(1 < s.num_kv_heads < s.num_q_heads for s in shapes)  # GQA
    assert any(s.num_kv_heads == 1 for s in shapes)  # MQA
    assert any(s.head_size & (s.head_size - 1) for s in shapes)  # pads to a power of two
    assert any(s.head_size_v != s.head_size for s in shapes)
    assert {v.dtype for v in VARIANTS if isinstance(v, CacheWrite)} == set(DTYPES)


def test_every_variant_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: compile everything, reuse nothing
    code = "from tests.kernels.test_gpu_compile import compile_matrix; compile_matrix()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    results = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    expected = variant_names()
    if result.returncode != 0:
        progress = [line.partition(" ")[::2] for line in result.stderr.splitlines()]
        started = [name for word, name in progress if word == STARTED]
        finished = {name for word, name in progress if word == FINISHED}
        in_flight = [name for name in started if name not in finished]
        message = f"The compile process died compiling one of {in_flight}:"
        pytest.fail(f"{message}\n{result.stderr[-4000:]}", pytrace=False)
    failures = [f"{r['name']}:\n{r['error']}" for r in results if "error" in r]
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    assert [r["name"] for r in results] == expected
    assert all(r["cubin_bytes"] > 0 for r in results)
    too_big = [r for r in results if r["shared_bytes"] > MAX_SHARED_BYTES[r["name"].split()[0]]]
    assert not too_big, too_big


# --- The child process: record each launcher's launch, then compile it for every arch. ---


def compile_matrix() -> None:
    """Prints one JSON line per entry of ``variant_names()``, in order: its cubin and shared
    memory sizes, or the error that stopped it. Workers are spawned, not forked: a fresh
    interpreter inherits none of torch's threads."""
    assert "TRITON_INTERPRET" not in os.environ, "under the interpreter nothing is compiled"
    jobs = list(itertools.product(range(len(VARIANTS)), ARCHS))
    num_workers = min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_workers, mp_context=context) as pool:
        for name, report in pool.map(_compile_job, jobs):
            print(json.dumps({"name": name, **report}), flush=True)


def _compile_job(job: tuple[int, str]) -> tuple[str, dict]:
    index, arch = job
    variant = VARIANTS[index]
    name = f"{arch} {variant.name}"
    print(f"{STARTED} {name}", file=sys.stderr, flush=True)  # names the variant of a crash
    try:
        kernel, args, constexprs = _record(variant)
        _check_launch(variant, constexprs)
        report = _compile(kernel, args, constexprs, ARCHS[arch])
    except Exception as error:  # the message, for this variant only
        report = {"error": _describe(error)}
    print(f"{FINISHED} {name}", file=sys.stderr, flush=True)
    return name, report


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **constexprs)`` is recorded."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((args, constexprs))


def _record(variant):
    """(kernel, args, constexprs) of the one launch the real launcher makes for ``variant``."""
    module, kernel_name, launch = _launcher_call(variant)
    kernel, recorder = getattr(module, kernel_name), _Recorder()
    setattr(module, kernel_name, recorder)
    try:
        launch()
    finally:
        setattr(module, kernel_name, kernel)
    ((args, constexprs),) = recorder.launches
    return kernel, args, constexprs


def _launcher_call(variant):
    """(module, kernel name, call of the module's launcher) on tensors of the variant's shape,
    for a batch of two requests: the first sets the tile, the second is a decode."""
    import torch

    import kvcore
    from kernels.attention import cache_write, paged_attention
    from kernels.attention.metadata import build_attention_metadata
    from kernels.attention.params import AttentionParams

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[variant.dtype]
    s = variant.shape
    spec = kvcore.FullAttentionSpec(
        block_size=16, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
        head_size_v=s.head_size_v, dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    tensor = kvcore.build_kv_cache_tensor(spec, ["l"], 16, "BHLNC")
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    cache = kvcore.create_kv_cache_views(raw, spec, 16, "BHLNC", tensor)["l"]
    query_lens = [128 if getattr(variant, "tile", None) == "prefill" else 1, 1]
    tables = [list(range(13)), [13, 14, 15]]
    metadata = build_attention_metadata(query_lens, [200, 37], tables, 16)
    num_tokens = sum(query_lens)
    if isinstance(variant, CacheWrite):
        key = torch.zeros(num_tokens, s.num_kv_heads, s.head_size, dtype=dtype)
        value = torch.zeros(num_tokens, s.num_kv_heads, s.head_size_v, dtype=dtype)
        call = functools.partial(cache_write.write_kv, key, value, cache, metadata.slot_mapping)
        return cache_write, "_cache_write_kernel", call
    params = AttentionParams(
        scale=0.1, num_kv_heads=s.num_kv_heads, head_size_v=s.head_size_v,
        sliding_window=512 if "window" in variant.features else None,
        softcap=30.0 if "softcap" in variant.features else None,
        sinks=torch.zeros(s.num_q_heads) if "sinks" in variant.features else None,
    )  # fmt: skip
    query = torch.zeros(num_tokens, s.num_q_heads, s.head_size, dtype=dtype)
    call = functools.partial(paged_attention.paged_attention, query, cache, metadata, params)
    return paged_attention, "_paged_attention_kernel", call


def _check_launch(variant, constexprs) -> None:
    """The launcher chose the tile and switches the variant is named for."""
    from kernels.attention.paged_attention import DECODE_BLOCK_M, PREFILL_BLOCK_M

    if isinstance(variant, CacheWrite):
        return
    num_rows = constexprs["BLOCK_Q"] * constexprs["QPK_PAD"]
    expected_rows = DECODE_BLOCK_M if variant.tile == "decode" else PREFILL_BLOCK_M
    assert num_rows == expected_rows, f"the launcher chose {num_rows} rows, not {expected_rows}"
    switches = {f: constexprs[f"HAS_{f.upper()}"] for f in FEATURES}
    assert switches == {f: f in variant.features for f in FEATURES}, switches


class _AbsentGpu:
    """The three things triton's launch path asks a driver for, for a GPU that is not here.
    Enough to compile (``warmup``), never to launch."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_device(self) -> int:
        return self.arch  # one device per arch keeps triton's per-device caches apart

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)


def _compile(kernel, args, constexprs, arch: int) -> dict[str, int]:
    """Compiles the launch as the GPU's own launch would: triton types and specialises the
    real arguments (dtypes, unit strides, 16-byte alignment) and takes its default options."""
    from triton.runtime import driver

    driver.set_active(_AbsentGpu(arch))  # this process only compiles: never set back
    compiled = kernel.warmup(*args, grid=(1,), **constexprs)
    return {"cubin_bytes": len(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared}


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[-3000:]
