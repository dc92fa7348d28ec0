"""Fixtures the worker tests share."""

from __future__ import annotations

import pytest

from tests.workers.hf_models import save_model
from tests.workers.stage_helpers import save_stage_checkpoint
from tests.workers.test_gguf import ALL_QUANTIZED, MIXED, write_gguf


@pytest.fixture(scope="module")
def quantized_files(tmp_path_factory):
    """(transformers directory, GGUF) for the all-quantized and the mixed type sets."""
    root = tmp_path_factory.mktemp("quantized")
    files = {}
    for name, types in (("all", ALL_QUANTIZED), ("mixed", MIXED)):
        hf_dir = save_model("llama", root / f"hf-{name}")
        write_gguf(hf_dir, root / f"{name}.gguf", types)
        files[name] = (hf_dir, root / f"{name}.gguf")
    return files


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (model dir, layout, prefill chunk), made once per module
    (``stage_helpers.save_stage_checkpoint``)."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = save_stage_checkpoint(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get
