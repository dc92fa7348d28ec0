"""The worker inside a real Ray actor: spec report, cache allocation and one step, as bytes."""

from __future__ import annotations

import pytest

from kvcore import RankReport, decode, encode, get_kv_cache_config
from workers.protocol import NewRequest, StepPlan, StepResult
from workers.sampling import SamplingParams
from workers.worker import WorkerOptions

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_worker_actor_serves_a_step(local_ray):
    from workers.actor import remote_worker_class

    actor = remote_worker_class(num_cpus=1).remote(
        0, WorkerOptions(kv_cache_memory_bytes=4 << 20, block_size=16)
    )
    assert ray.get(actor.rendezvous_address.remote()).startswith("tcp://")
    ray.get(actor.init_tp_group.remote(None))
    ray.get(actor.load_model.remote())
    report = decode(ray.get(actor.report_specs.remote()), RankReport)
    assert report.rank == 0 and len(report.specs) == 4
    assert "BLHNC" in report.supported_layouts
    config = get_kv_cache_config(
        report.specs,
        report.free_memory_bytes,
        "LBNHC",
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    assert ray.get(actor.allocate_kv_cache.remote(encode(config))) >= 4 << 19
    plan = StepPlan(
        new_requests=[
            NewRequest(
                request_id="a",
                token_ids=list(b"hi there"),
                sampling=SamplingParams(temperature=0),
                block_ids=[[1]],
                num_computed_tokens=0,
                num_new_tokens=8,
            )
        ]
    )
    result = decode(ray.get(actor.execute.remote(encode(plan))), StepResult)
    assert list(result.sampled) == ["a"] and 0 <= result.sampled["a"] < 258
    health = ray.get(actor.health.remote())
    assert health["model_loaded"] and health["num_requests"] == 1
