"""NemotronH (Mamba-2 + attention + MLP hybrid): kvray's greedy tokens equal transformers'
``generate``, token for token, with every Mamba state in kvcore's KV cache.

Each case runs the three prompts together (continuous batching: one request decodes while
others still prefill) in prefill chunks that do not end on the SSD's chunk boundaries (8), and
compares with transformers run one prompt at a time.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from kvcore import KVCacheGeometryError, KVCacheLayout, KVCacheLayoutError, decode, encode
from tests.workers.engine import (
    plan_for,
    prompt_batches,
    run_in_process,
    run_tensor_parallel,
    start_worker,
    tiny_model_options,
)
from tests.workers.harness import StepDriver
from tests.workers.hf_models import NUM_OUTPUT_TOKENS, PROMPTS, reference_generations
from tests.workers.hf_models import save_nemotron_h as save_model
from workers.loader import load_state_dict, load_weights
from workers.models.nemotron_h import NemotronHForCausalLM
from workers.models.registry import load_model_config
from workers.protocol import StepResult
from workers.worker import Worker

LIST_FORM = ["full_attention", "linear_attention", "mlp", "linear_attention"]
MODELS = {
    # name -> (layers: legacy pattern string or layers_block_type list, n_groups)
    "M*-M-/g2": ("M*-M-", 2),
    "MM*-/g1": ("MM*-", 1),
    "list/g2": (LIST_FORM, 2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, reference outputs by request id)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            layers, n_groups = MODELS[name]
            directory = save_model(tmp_path_factory.mktemp("nemotron_h"), layers, n_groups)
            reference = reference_generations(directory, PROMPTS)
            cache[name] = directory, {f"r{i}": out for i, out in enumerate(reference)}
        return cache[name]

    return get


options = tiny_model_options


def batches():
    return prompt_batches(PROMPTS, NUM_OUTPUT_TOKENS)


CASES = [
    # model, layout, tensor parallel size, prefill chunk
    ("M*-M-/g2", "LBNHC", 1, 7),
    ("MM*-/g1", "BLHNC", 1, 5),
    ("list/g2", "BLNHC", 1, 64),
    ("M*-M-/g2", "BLHNC", 2, 6),
    ("MM*-/g1", "LHBNC", 2, 7),
]


@pytest.mark.parametrize(("name", "layout", "tp", "chunk"), CASES)
def test_greedy_tokens_match_transformers(models, name, layout, tp, chunk):
    model_dir, expected = models(name)
    run = run_in_process if tp == 1 else run_tensor_parallel
    assert run(options(model_dir, tp=tp), layout, batches(), chunk=chunk) == expected
    # The model must not be trivially repetitive, or this comparison would prove little.
    assert all(len(set(tokens)) > 8 for tokens in expected.values())


def test_every_layout_serves_or_is_refused_by_the_planner(models):
    """Each layout the planner accepts for the hybrid serves exact tokens; the others are
    refused by kvcore's planner, naming the layout, before anything runs."""
    model_dir, expected = models("M*-M-/g2")
    worker = Worker(0, options(model_dir))
    worker.init_tp_group(None)
    worker.load_model()
    served, refused = [], {}
    for layout in KVCacheLayout:
        try:
            plan_for(worker, layout.name)
        except (KVCacheLayoutError, KVCacheGeometryError) as exc:
            refused[layout.name] = str(exc)
            continue
        served.append(layout.name)
        assert run_in_process(options(model_dir), layout.name, batches(), chunk=9) == expected
    assert served == ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
    # Mixed pages need a block-compact layout; LHBNC cannot pad the 2-head attention page.
    assert "layout BHLNC cannot express this model's mixed page sizes" in refused["BHLNC"]
    assert "got LHBNC" in refused["LHBNC"]


def test_preempted_requests_recompute_their_state(models):
    """Preempted after some outputs, a request comes back in its old (stale) state blocks and
    recomputes prompt and outputs; chunks that straddle the prompt's end take the prompt's dt
    floor for prompt tokens only."""
    model_dir, expected = models("MM*-/g1")
    worker = start_worker(options(model_dir), "LBNHC")
    config = worker.runner.config
    driver = StepDriver(config, lambda p: decode(worker.execute(encode(p)), StepResult))
    requests = [(f"r{i}", p, NUM_OUTPUT_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = driver.generate(requests, chunk=7, preempt_after={"r0": 20, "r1": 12, "r2": 25})
    assert outputs == expected


@pytest.mark.parametrize(("name", "layout", "chunk"), [("M*-M-/g2", "BLHNC", 7)])
def test_triton_backend_matches_transformers(models, name, layout, chunk):
    """The Triton attention and Mamba kernels (the interpreter on CPUs: a short run). Greedy
    outputs are prefixes of longer ones, so the first tokens are compared."""
    model_dir, expected = models(name)
    num_tokens = 6
    requests = [[(f"r{i}", p, num_tokens, None) for i, p in enumerate(PROMPTS)]]
    outputs = run_in_process(options(model_dir, backend="triton"), layout, requests, chunk=chunk)
    assert outputs == {rid: tokens[:num_tokens] for rid, tokens in expected.items()}


def test_checkpoint_names_with_either_prefix_load_the_same_weights(models):
    """transformers writes ``backbone.`` (as published checkpoints do); ``model.`` names load
    the same; the mixer keeps ``A = -exp(A_log)`` in float32."""
    model_dir, _ = models("M*-M-/g2")
    config = load_model_config(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    from_backbone = NemotronHForCausalLM(config)
    load_weights(from_backbone, model_dir, show_progress=False)
    from_model = NemotronHForCausalLM(config)
    load_state_dict(from_model, {k.replace("backbone.", "model."): v for k, v in tensors.items()})
    for (name, ours), (_, theirs) in zip(
        from_backbone.state_dict().items(), from_model.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    mixer = from_backbone.model.layers[0].mixer
    assert mixer.A.dtype == torch.float32
    assert torch.equal(mixer.A, -torch.exp(tensors["backbone.layers.0.mixer.A_log"].float()))


@pytest.mark.parametrize(
    ("backend", "tp", "layout", "num_tokens"),
    [
        ("torch", 1, "BLHNC", NUM_OUTPUT_TOKENS),
        ("torch", 2, "LBNHC", 12),
        ("triton", 1, "BLNHC", 5),
    ],
)
def test_a_prefix_hit_resumes_from_a_checkpointed_state(models, backend, tp, layout, num_tokens):
    """With prefix caching the Mamba states are kept every 8 tokens. The first request's
    prompt (19 tokens) is prefilled in chunks of 5, so its steps end at 5, 10, 15 and 19: the
    states at 8 and 16 exist only as checkpoints, which the second request (sharing 17 tokens)
    resumes from at 16. Both match transformers token for token."""
    model_dir, expected = models("M*-M-/g2")
    shared = PROMPTS[0][:17]
    second = [*shared, 90, 91, 92, 93]
    (second_expected,) = reference_generations(model_dir, [second], num_tokens)
    caching = dict(enable_prefix_caching=True, mamba_state_interval=8, max_num_batched_tokens=256)
    run = run_in_process if tp == 1 else run_tensor_parallel
    outputs = run(
        msgspec.structs.replace(options(model_dir, backend=backend, tp=tp), **caching),
        layout,
        [
            [("r0", PROMPTS[0], num_tokens, None)],
            [("again", second, num_tokens, "r0")],
        ],
        chunk=5,
    )
    assert outputs == {"r0": expected["r0"][:num_tokens], "again": second_expected}
