"""Every C kernel compiles for each x86-64 level a user's CPU may be, not only for the CPU
this runs on: a kernel built with ``-march=native`` takes the branches of its preprocessor
switches that this CPU's features pick, so a call into a branch left out elsewhere (an AVX2
helper defined only where AVX-512 is absent, say) would build here and load elsewhere with an
undefined symbol. The levels: x86-64 (SSE2), v2 (SSE4.2), v3 (AVX2, FMA, F16C), v4 (AVX-512),
and v4 with AVX-512 VNNI (the GGUF matmul's split-byte form). Compiling for a level needs no
CPU of that level."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.c_build import BASE_FLAGS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(ROOT.glob("kernels/**/cpu/*.c"))
LEVELS = {
    "x86-64": ["-march=x86-64"],
    "x86-64-v2": ["-march=x86-64-v2"],
    "x86-64-v3": ["-march=x86-64-v3"],
    "x86-64-v4": ["-march=x86-64-v4"],
    "x86-64-v4-vnni": ["-march=x86-64-v4", "-mavx512vnni"],
}
COMPILER = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(
    COMPILER is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C compiler targeting x86-64",
)


def test_the_kernels_are_found():
    names = {source.name for source in SOURCES}
    expected = {"gguf_matmul.c", "paged_decode.c", "decoder_layer.c", "shm_collectives.c"}
    assert expected <= names, names


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda source: source.name)
def test_each_kernel_compiles_and_links_for_each_level(tmp_path, source, level):
    library = tmp_path / f"{source.stem}.so"
    command = [COMPILER, *BASE_FLAGS, "-fopenmp", *LEVELS[level], str(source)]
    # -Wl,--no-undefined: a symbol no library provides fails the link, as loading it would.
    command += ["-o", str(library), "-lm", "-lgomp", "-Wl,--no-undefined"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
