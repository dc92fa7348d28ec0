"""The startup handshake for a hybrid (NemotronH): each rank's Mamba state specs must be the
global ones sharded for it (heads split, a single B/C group replicated), or startup is refused
naming the rank, the layer and the field."""

from __future__ import annotations

import msgspec
import pytest

from cluster.config import EngineConfig
from cluster.startup import plan_kv_cache
from kvcore import GeometryMismatchError, RankReport
from workers.kv_specs import rank_kv_cache_specs
from workers.models.registry import parse_hf_config

RAW = {
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 8,
    "ssm_state_size": 16,
    "n_groups": 1,
    "hybrid_override_pattern": "M*-M-",
}


CONFIG = EngineConfig(
    tensor_parallel_size=2, kv_cache_layout="BLHNC", block_size=16, attention_backend="torch"
)


def reports(model_config, tp: int) -> list[RankReport]:
    """What each rank reports with the engine's settings (Mamba states kept for caching)."""
    return [
        RankReport(
            rank=rank,
            specs=rank_kv_cache_specs(
                model_config, 16, tp, rank, state_caching=CONFIG.state_caching()
            ),
            supported_layouts=["BLHNC", "LBNHC"],
            free_memory_bytes=8 << 20,
        )
        for rank in range(tp)
    ]


def test_tp2_reports_of_a_hybrid_agree_and_plan():
    model_config = parse_hf_config(RAW)
    plan = plan_kv_cache(reports(model_config, 2), model_config, CONFIG)
    names = sorted(name for group in plan.kv_cache_groups for name in group.layer_names)
    assert names == ["model.layers.0.mixer", "model.layers.1.mixer.attn", "model.layers.3.mixer"]


def test_a_rank_with_unsharded_mamba_state_is_refused():
    model_config = parse_hf_config(RAW)
    bad = reports(model_config, 2)
    whole = rank_kv_cache_specs(model_config, 16, 1, 0, state_caching=CONFIG.state_caching())
    whole = whole["model.layers.3.mixer"]
    bad[1] = msgspec.structs.replace(bad[1], specs=bad[1].specs | {"model.layers.3.mixer": whole})
    with pytest.raises(GeometryMismatchError, match=r"rank 1.*model\.layers\.3\.mixer.*shapes"):
        plan_kv_cache(bad, model_config, CONFIG)
