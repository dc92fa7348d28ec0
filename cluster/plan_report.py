"""``kvray plan``: the KV-cache plan of a model on one rank, without loading any weights."""

from __future__ import annotations

from collections.abc import Mapping

from cluster.config import EngineConfig
from cluster.startup import plan_options
from kernels.attention import get_attention_backend
from kvcore import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    get_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    iter_layer_specs,
    resolve_kv_cache_layout,
    shard_kv_cache_spec,
)
from workers.kv_specs import rank_kv_cache_specs
from workers.model_config import ModelConfig
from workers.model_source import model_display_name


def rank_specs(
    config: EngineConfig, model_config: ModelConfig, layers: range | None = None
) -> dict[str, KVCacheSpec]:
    """Rank 0's layer specs (of ``layers`` only, a pipeline stage's, when given)."""
    backend = get_attention_backend(config.attention_backend or "torch")  # same geometry
    return rank_kv_cache_specs(
        model_config,
        config.block_size,
        config.tensor_parallel_size,
        0,
        backend.customize_spec,
        config.cache_dtype(model_config.dtype),
        config.state_caching(),
        model_dtype=config.model_dtype(model_config.dtype),
        num_speculative_tokens=config.num_speculative_tokens,
        layers=layers,
    )


def chosen_layout(config: EngineConfig, specs: Mapping[str, KVCacheSpec]) -> str:
    backend = get_attention_backend(config.attention_backend or "torch")
    supported = [layout.name for layout in backend.supported_kv_cache_layouts()]
    tp = config.tensor_parallel_size
    return resolve_kv_cache_layout(config.kv_cache_layout, [supported] * tp, specs.values())


def group_lines(kv: KVCacheConfig, indent: str = "  ") -> list[str]:
    lines = []
    for index, group in enumerate(kv.kv_cache_groups):
        spec = group.kv_cache_spec
        stored = getattr(spec, "dtype", None) or "/".join(getattr(spec, "dtypes", ()))
        lines.append(
            f"{indent}[{index}] {type(spec).__name__}: {len(group.layer_names)} layers, block "
            f"{spec.block_size} tokens, page {spec.page_size_bytes} bytes "
            f"(H={spec.num_heads} N={spec.num_states} C={spec.state_content_size_bytes}, "
            f"{stored})"
        )
    return lines


def plan_report(config: EngineConfig, model_config, layouts: list[str] | None = None) -> str:
    tp = config.tensor_parallel_size
    specs = rank_specs(config, model_config)
    chosen = chosen_layout(config, specs)
    memory = config.kv_cache_memory_bytes or 0
    options = plan_options(config, model_config)
    kv = get_kv_cache_config(specs, memory, chosen, **options)
    lines = [
        f"model: {model_display_name(config.model)} ({model_config.architecture}), "
        f"TP {tp}, {model_config.num_hidden_layers} layers",
        f"layout: {kv.layout}; KV memory per rank: {memory} bytes",
        f"blocks: {kv.num_blocks} x {kv.bytes_per_block} bytes; scheduler block "
        f"{kv.scheduler_block_size} tokens, hash block {kv.hash_block_size}",
        f"fits: {kv.capacity_tokens} tokens, max concurrency {kv.max_concurrency:.2f}x at "
        f"{kv.max_model_len} tokens",
        "groups:",
        *group_lines(kv),
    ]
    lines.extend(state_caching_lines(config, kv))
    lines.extend(latent_lines(model_config, specs, kv, tp, options))
    lines.extend(expert_lines(model_config, tp, config.enable_expert_parallel))
    lines.append("strides per layout (layer_stride, block_stride, offset) of each tensor:")
    for layout in layouts or [layout.name for layout in KVCacheLayout]:
        try:
            other = get_kv_cache_config(specs, memory, layout, **options)
        except ValueError as exc:
            lines.append(f"  {layout}: cannot express this model: {exc}")
            continue
        tensors = "; ".join(
            f"{len(t.layers)} layers ({t.layer_stride}, {t.block_stride}, {t.offset})"
            for t in other.kv_cache_tensors
        )
        lines.append(f"  {KVCacheLayout.parse(layout).name}: {tensors}")
    return "\n".join(lines)


def state_caching_lines(config: EngineConfig, kv) -> list[str]:
    """What keeping Mamba states for the prefix cache costs, for hybrids."""
    mamba_groups = [
        group
        for group in kv.kv_cache_groups
        if any(isinstance(spec, MambaSpec) for spec in iter_layer_specs(group.kv_cache_spec))
    ]
    if not mamba_groups:
        return []
    caching = config.state_caching()
    lines = []
    if caching is None:
        lines.append("mamba states: one per request, no prefix-cache hits (prefix caching is off)")
    else:
        # Each group's state block is a whole pool block, whatever its page.
        per_step = caching.num_checkpoints * len(mamba_groups) * kv.bytes_per_block
        lines.append(
            f"mamba states: one kept every {caching.interval} tokens for prefix caching "
            f"(--mamba-state-interval); a step checkpoints up to {caching.num_checkpoints} per "
            f"group, {per_step} bytes in blocks until they are cached, then evictable"
        )
    if config.num_speculative_tokens:
        lines.append(
            f"mamba draft states: {config.num_speculative_tokens} per request and group "
            "(--speculative-config), to undo rejected drafts"
        )
    return lines


def latent_lines(
    model_config: ModelConfig,
    specs: Mapping[str, KVCacheSpec],
    kv: KVCacheConfig,
    tp: int,
    options: dict,
) -> list[str]:
    """What MLA's latent saves: the same pool planned as the full K/V cache that this rank's
    query heads would need without it (the comparison upstream vLLM makes). The latent is whole
    on every rank; the full cache's heads would be split over the ranks."""
    latents = [spec for spec in specs.values() if isinstance(spec, MLAAttentionSpec)]
    if not latents:
        return []
    latent, mla = latents[0], model_config.mla
    whole = FullAttentionSpec(
        block_size=latent.block_size,
        num_kv_heads=model_config.num_attention_heads,
        head_size=mla.qk_head_dim,
        head_size_v=mla.v_head_dim,
        dtype=latent.dtype,
    )
    full = shard_kv_cache_spec(whole, tp, 0)
    full_specs = {
        name: full if isinstance(spec, MLAAttentionSpec) else spec for name, spec in specs.items()
    }
    # The latent pool's bytes, unchecked: a full cache may not hold one request at
    # max_model_len. Without the override, which would fix the block count instead.
    full_kv = get_kv_cache_config_from_groups(
        get_kv_cache_groups(full_specs, kv.layout),
        kv.num_blocks * kv.bytes_per_block,
        kv.layout,
        **(options | {"num_blocks_override": None}),
    )
    latent_bytes = latent.page_size_bytes // latent.block_size
    full_bytes = full.page_size_bytes // full.block_size
    return [
        f"latent (MLA): {latent_bytes} bytes per token per layer, page {latent.page_size_bytes} "
        "bytes per block",
        f"  vs a full K/V cache of this rank's {full.num_kv_heads} query heads x "
        f"({mla.qk_head_dim} + {mla.v_head_dim}): {full_bytes} bytes per token per layer "
        f"({full_bytes / latent_bytes:.1f}x the latent); the same memory would fit "
        f"{full_kv.capacity_tokens} tokens instead of {kv.capacity_tokens}",
    ]


def expert_lines(model_config: ModelConfig, tp: int, expert_parallel: bool) -> list[str]:
    """A MoE model's experts and what each rank holds of them (refused here, before any
    worker starts, when they cannot be split so)."""
    moe = model_config.moe
    if moe is None:
        return []
    shared = (
        f", a shared expert of {moe.shared_expert_intermediate_size} rows"
        if moe.shared_expert_intermediate_size
        else ""
    )
    lines = [
        f"experts: {len(moe.layers)} MoE layers of {moe.num_experts} experts "
        f"({moe.intermediate_size} rows each), top {moe.top_k}{shared}; "
        + (
            "whole experts per rank (expert parallel)"
            if expert_parallel
            else "every expert split over the ranks"
        )
    ]
    for rank in range(tp):
        shard = moe.placement(tp, rank, expert_parallel)
        end = shard.intermediate_start + shard.intermediate_size
        lines.append(
            f"  rank {rank}: experts [{shard.first_expert}, "
            f"{shard.first_expert + shard.num_experts}), rows [{shard.intermediate_start}, {end}) "
            "of each"
        )
    return lines
