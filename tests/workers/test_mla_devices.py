"""What a GPU would catch in a DeepSeek (MLA) step, checked on the CPU.

- Every tensor of the MLA path (its metadata, the latent gather, the expansion, the absorbed
  projections) takes its device from its inputs: with the default device switched to ``meta``
  the steps give exactly the tokens they give normally (see ``test_step_devices``).
- The memory profile runs the MLA layer's largest expansion: its prefill expands the step's
  whole token budget, the most any serving step may expand, so the scratch is in the peak.
"""

from __future__ import annotations

import pytest

from kernels.mla import get_mla_backend
from kvcore import RankReport, decode
from tests.workers.hf_models import save_deepseek
from tests.workers.test_memory_budget import AFTER, BEFORE, ScriptedProbe
from tests.workers.test_step_devices import run_steps
from workers.worker import Worker, WorkerOptions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_deepseek(tmp_path_factory.mktemp("deepseek"), q_lora_rank=24)


def test_no_mla_step_tensor_falls_back_to_the_default_device(model_dir):
    """The torch backends: the MLA path's own tensors (metadata, gather, expansion,
    projections) are the same whichever kernels run; the Triton MLA launchers add only their
    split workspace, made on the query's device."""
    expected = run_steps("torch", implicit_device=None, model=str(model_dir))
    assert run_steps("torch", implicit_device="meta", model=str(model_dir)) == expected


class RecordingAttend:
    """The attention backend, noting the expanded K/V each prefill hands it."""

    def __init__(self, backend):
        self._backend = backend
        self.expanded_tokens: list[int] = []

    def attend(self, query, kv_cache, metadata, params, out=None):
        self.expanded_tokens.append(kv_cache.shape[0])  # one context token per block
        return self._backend.attend(query, kv_cache, metadata, params, out)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_the_profile_step_expands_the_whole_token_budget(model_dir):
    options = WorkerOptions(model=str(model_dir), max_num_batched_tokens=40, max_num_seqs=6)
    worker = Worker(0, options)
    worker.backend = RecordingAttend(worker.backend)
    worker.memory = ScriptedProbe(BEFORE, AFTER)
    worker.init_tp_group(None)
    worker.load_model()
    assert get_mla_backend(worker.backend.name).name == get_mla_backend("torch").name

    report = decode(worker.report_specs(), RankReport)

    # One 35-token prompt and five one-token ones: the prompt expands (35 of the budget of 40,
    # in each of the two layers); the one-token requests attend in latent space.
    assert worker.backend.expanded_tokens == [35, 35]
    assert report.free_memory_bytes > 0
