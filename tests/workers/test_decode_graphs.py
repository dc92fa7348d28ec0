"""Decode steps replayed from CUDA graphs, emulated on the CPU (``workers.cuda_graphs``):
the region a GPU would capture runs over the graph's static buffers and the step objects
frozen at "capture", so anything it read from a step other than through those buffers would
give wrong tokens here as on a GPU. CUDA itself is what is faked: no graph is recorded.

The prompts prefill in one step, then the requests stop after different numbers of tokens, so
decode runs 3 requests (padded to a graph of 4), then 2, then 1; one is preempted and comes
back (its recompute is an eager step). Every replay runs under a guard
that refuses host syncs and host-built tensors (``tests.host_sync_guard``), which a capture
would refuse on a GPU.
"""

from __future__ import annotations

import pytest

from kvcore import decode, encode
from tests.host_sync_guard import HostSyncError, refuse_host_syncs
from tests.workers.engine import start_worker, tiny_model_options
from tests.workers.harness import StepDriver
from tests.workers.hf_models import PROMPTS, reference_generations, save_deepseek, save_model
from workers.cuda_graphs import graph_batch_sizes, padded_batch_size
from workers.protocol import StepResult

MAX_TOKENS = [10, 4, 7]  # per prompt: decode batches of 3, 2 and 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, transformers' greedy tokens by request id)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            if name == "deepseek":
                save_deepseek(directory, q_lora_rank=24)
            else:
                save_model(name, directory)
            reference = reference_generations(directory, PROMPTS, max(MAX_TOKENS))
            cache[name] = directory, {f"r{i}": out for i, out in enumerate(reference)}
        return cache[name]

    return get


def _guarded(graphs):
    """Every replay of ``graphs`` under the host-sync guard."""
    replay = graphs.replay

    def guarded(size, num_reqs):
        with refuse_host_syncs():
            return replay(size, num_reqs)

    graphs.replay = guarded


def _generate(model_dir, layout: str, *, graphs: bool, preempt: bool = False):
    worker = start_worker(tiny_model_options(model_dir, backend="triton"), layout)
    if graphs:
        assert worker.runner.use_decode_graphs("emulate")
        _guarded(worker.runner.graphs)
    driver = StepDriver(
        worker.runner.config, lambda plan: decode(worker.execute(encode(plan)), StepResult)
    )
    requests = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]
    outputs = driver.generate(requests, chunk=64, preempt_after={"r2": 3} if preempt else None)
    return outputs, worker.runner.graphs


@pytest.mark.parametrize(
    ("name", "layout", "preempt"),
    [
        ("llama", "LBNHC", True),
        ("qwen3-sliding", "BLHNC", False),  # a full and a sliding-window group
        ("deepseek", "BLHNC", False),  # MLA: decode attends in latent space
    ],
)
def test_graph_decode_gives_transformers_tokens(models, name, layout, preempt):
    model_dir, expected = models(name)
    outputs, graphs = _generate(model_dir, layout, graphs=True, preempt=preempt)
    assert outputs == {rid: tokens[: len(outputs[rid])] for rid, tokens in expected.items()}
    assert [len(outputs[f"r{i}"]) for i in range(3)] == MAX_TOKENS
    replayed = {size for size, count in graphs.num_replays.items() if count}
    assert replayed == {1, 2, 4}  # 3 requests ran padded to 4


def test_cpu_workers_decode_eagerly(models):
    """Graphs are a GPU worker's (unless --enforce-eager): a CPU worker never captures."""
    model_dir, _ = models("llama")
    worker = start_worker(tiny_model_options(model_dir, backend="triton"), "LBNHC")
    assert worker.runner.graphs is None


def test_kinds_without_graph_steps_stay_eager(tmp_path):
    """A hybrid's Mamba group has no static step: the runner says so and decodes eagerly."""
    from tests.workers.hf_models import save_nemotron_h

    worker = start_worker(
        tiny_model_options(save_nemotron_h(tmp_path, "M*-M", n_groups=2), backend="triton"), "BLHNC"
    )
    assert not worker.runner.use_decode_graphs("emulate")
    assert worker.runner.graphs is None


def test_batch_sizes_and_padding():
    assert graph_batch_sizes(256)[:5] == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(1024)) == 35
    assert graph_batch_sizes(6) == (1, 2, 4, 6)
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 9, 64, 65)] == [1, 4, 8, 16, 64, None]


def test_guard_catches_what_a_capture_refuses():
    """The guard itself: each way a decode region could read the device back."""
    import torch

    x = torch.arange(6.0)
    for read in (
        lambda: x.tolist(),
        lambda: x.sum().item(),
        lambda: torch.tensor([1, 2]),
        lambda: x[x > 2],
        lambda: bool(x.sum() > 0),
        lambda: torch.repeat_interleave(x.long()),
    ):
        with pytest.raises(HostSyncError), refuse_host_syncs():
            read()
    with refuse_host_syncs():  # device-side work passes
        (x * 2).cumsum(0).argsort()


def test_cuda_mode_warms_up_captures_into_one_pool_and_replays(models, monkeypatch):
    """The capture path a GPU takes, with CUDA's graph objects faked (there is no GPU here):
    each size runs once eagerly (compiling its kernels) and once under capture, the largest
    first, every later capture sharing the first one's memory pool; a step replays its size's
    graph and reads the output captured with it."""
    import contextlib

    import torch

    events = []

    class FakeGraph:
        def __init__(self):
            self.replays = 0

        def pool(self):
            return "the first graph's pool"

        def replay(self):
            self.replays += 1

    @contextlib.contextmanager
    def fake_capture(graph, pool=None):
        events.append(("capture", pool))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append(("sync", None)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    model_dir, _ = models("llama")
    worker = start_worker(tiny_model_options(model_dir, backend="triton"), "LBNHC")
    runner = worker.runner
    forward = runner.model.forward
    outputs = []

    def recording_forward(token_ids, positions):
        events.append(("forward", token_ids.shape[0]))
        outputs.append(forward(token_ids, positions))
        return outputs[-1]

    monkeypatch.setattr(runner.model, "forward", recording_forward)
    runner.limits = type(runner.limits)(runner.limits.max_num_batched_tokens, 4)
    assert runner.use_decode_graphs("cuda")
    assert events == [
        ("forward", 4), ("sync", None), ("capture", None), ("forward", 4),
        ("forward", 2), ("sync", None), ("capture", "the first graph's pool"), ("forward", 2),
        ("forward", 1), ("sync", None), ("capture", "the first graph's pool"), ("forward", 1),
    ]  # fmt: skip
    captured_for_2 = outputs[3]  # the second forward of size 2: the one under capture
    graphs = runner.graphs
    assert graphs.replay(2, 2).data_ptr() == captured_for_2.data_ptr()
    assert graphs.num_replays == {1: 0, 2: 1, 4: 0}
