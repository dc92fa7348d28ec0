"""Multi-head latent attention layers (DeepSeek's ``mla_attention``): one ``MLAAttentionSpec``
each, a single latent "head" of ``kv_lora_rank + qk_rope_head_dim`` values per token and no
separate V. The query heads are split over the TP ranks but the latent is not: kvcore keeps an
MLA spec whole on every rank, and the startup rank check compares each rank's latent with the
whole one."""

from __future__ import annotations

from kvcore import KVCacheSpec, MLAAttentionSpec
from workers.kinds.attention import ATTENTION
from workers.kinds.base import CacheKind, SpecContext
from workers.model_config import UnsupportedModelError


def _latent_spec(context: SpecContext, index: int) -> KVCacheSpec:
    config = context.config
    if config.num_attention_heads % context.tp_size:
        raise UnsupportedModelError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by tensor "
            f"parallel size {context.tp_size}: MLA splits the query heads over the ranks (each "
            "keeps the whole latent); choose a tensor parallel size that divides it."
        )
    return MLAAttentionSpec(
        block_size=context.block_size,
        num_kv_heads=1,
        head_size=config.mla.latent_size,
        head_size_v=0,
        dtype=context.dtype,
    )


MLA = CacheKind(
    name="mla",
    layer_types=("mla_attention",),
    spec_types=(MLAAttentionSpec,),
    layer_name=ATTENTION.layer_name,
    layer_spec=_latent_spec,
    step_builder="workers.kinds.mla_metadata:MLAStep",
)
