"""``kvray plan``: the KV-cache plan of a model on one rank, without loading any weights."""

from __future__ import annotations

from cluster.config import EngineConfig
from cluster.startup import max_model_len_for
from kernels.backends import get_attention_backend
from kvcore import (
    KVCacheLayout,
    MambaSpec,
    get_kv_cache_config,
    iter_layer_specs,
    resolve_kv_cache_layout,
)
from workers.default_model import model_display_name
from workers.kv_specs import rank_kv_cache_specs


def plan_report(config: EngineConfig, model_config, layouts: list[str] | None = None) -> str:
    backend = get_attention_backend(config.attention_backend or "torch")  # same geometry
    tp = config.tensor_parallel_size
    specs = rank_kv_cache_specs(
        model_config,
        config.block_size,
        tp,
        0,
        backend.customize_spec,
        config.dtype or model_config.dtype,
        config.state_caching(),
    )
    supported = [layout.name for layout in backend.supported_kv_cache_layouts()]
    chosen = resolve_kv_cache_layout(config.kv_cache_layout, [supported] * tp, specs.values())
    memory = config.kv_cache_memory_bytes or 0
    options = dict(
        max_model_len=max_model_len_for(config, model_config),
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        num_blocks_override=config.num_gpu_blocks_override,
    )
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
    ]
    for index, group in enumerate(kv.kv_cache_groups):
        spec = group.kv_cache_spec
        lines.append(
            f"  [{index}] {type(spec).__name__}: {len(group.layer_names)} layers, block "
            f"{spec.block_size} tokens, page {spec.page_size_bytes} bytes "
            f"(H={spec.num_heads} N={spec.num_states} C={spec.state_content_size_bytes})"
        )
    lines.extend(state_caching_lines(config, kv))
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
    if caching is None:
        return ["mamba states: one per request, no prefix-cache hits (prefix caching is off)"]
    # Each group's state block is a whole pool block, whatever its page.
    per_step = caching.num_checkpoints * len(mamba_groups) * kv.bytes_per_block
    return [
        f"mamba states: one kept every {caching.interval} tokens for prefix caching "
        f"(--mamba-state-interval); a step checkpoints up to {caching.num_checkpoints} per "
        f"group, {per_step} bytes in blocks until they are cached, then evictable"
    ]
