"""The model geometry kvray needs, as every family's config parser fills it in from a Hugging
Face ``config.json`` (and the defaults of ``generation_config.json`` beside it): the struct,
the parts only some families have (RoPE scaling, a Mamba mixer, latent attention), and the
fields every family reads the same way (``common_fields``). Which parser reads which
architecture is ``workers.models.registry``'s."""

from __future__ import annotations

from typing import Any

import msgspec

from kvcore.dtypes import MODEL_DTYPES

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
ROUTING_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "topk_softmax")


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture or configuration kvray does not serve."""


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """How RoPE frequencies are stretched past the pretraining context (``rope_scaling`` or
    ``rope_parameters`` in config.json); ``workers/layers/rotary.py`` does the math."""

    rope_type: str  # "llama3" (Llama 3.1/3.2) or "yarn"
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0  # llama3: wavelengths past original / low are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept
    beta_fast: float = 32.0  # yarn: rotations bounding the interpolation ramp
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: with mscale_all_dim, sets the attention factor
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: cos/sin scale; None derives it from factor
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions


class MambaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The Mamba-2 mixer of a hybrid model's ``mamba`` layers (NemotronH's ``M``)."""

    num_heads: int
    head_dim: int
    state_size: int  # N, the SSM state per head channel
    n_groups: int  # B and C groups; heads h share group h // (num_heads // n_groups)
    conv_kernel: int
    chunk_size: int  # the SSD scan's chunk (a power of two)
    use_conv_bias: bool
    proj_bias: bool  # in_proj and out_proj (transformers reads ``use_bias``)
    # transformers floors dt at ``time_step_min`` in its chunked scan, which runs the prompt,
    # but not in its one-token recurrent step, which runs generated tokens; kvray does the same.
    dt_min: float
    ssm_cache_dtype: str = "float32"  # the SSM state; the conv state takes the model's dtype

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    def groups_per_rank(self, tp_size: int) -> int:
        """B/C groups on each rank: split when ``n_groups % tp == 0``; a single group is
        replicated on every rank; anything else is refused."""
        if self.num_heads % tp_size:
            raise UnsupportedModelError(
                f"mamba_num_heads={self.num_heads} is not divisible by tensor parallel size "
                f"{tp_size}; choose a tensor parallel size that divides it."
            )
        if self.n_groups % tp_size == 0:
            return self.n_groups // tp_size
        if self.n_groups == 1:
            return 1
        raise UnsupportedModelError(
            f"n_groups={self.n_groups} cannot be split over tensor parallel size {tp_size}: it "
            f"must be divisible by {tp_size} (groups are split) or be 1 (the group is "
            "replicated on every rank)."
        )


class MLAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-head latent attention (DeepSeek-V2/V3's ``mla_attention`` layers): every token
    caches one latent ``[kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)]`` shared by all heads."""

    kv_lora_rank: int  # L, the normalised latent that K's nope part and V are expanded from
    q_lora_rank: int | None  # None: a plain q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    qk_nope_head_dim: int  # P
    qk_rope_head_dim: int  # R, rotated; one key head shared by every query head
    v_head_dim: int  # V
    rope_interleave: bool  # rotate (x0, x1), (x2, x3)... pairs (GPT-J style), not halves
    attention_bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj carry biases

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Elements one token's cache entry holds."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MoEConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The mixture-of-experts MLP of a sparse model's MoE layers (Mixtral, Qwen2-MoE,
    Qwen3-MoE): a router scores ``num_experts`` experts per token, the ``top_k`` best run,
    and their outputs are summed by the router's weights."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's gate/up width
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    layers: tuple[int, ...]  # which decoder layers are MoE (the others keep a dense MLP)
    # Shared experts every token runs, this many rows in all (0: none): Qwen2-MoE's one,
    # scaled by sigmoid(shared_expert_gate) (gated); DeepSeek's, added as they are.
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    # How the router picks (ROUTING_METHODS): softmax top-k ("greedy"); DeepSeek-V2's
    # "group_limited_greedy" (the best top_group of n_group expert groups, by their best
    # score); DeepSeek-V3's "noaux_tc" (sigmoid scores plus a learned per-expert bias choose,
    # groups ranked by their two best); gpt-oss's "topk_softmax" (the top-k logits, then a
    # softmax over those k). The chosen weights are scaled by routed_scaling_factor.
    routing: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_in_float32: bool = False  # DeepSeek and NemotronH score in float32 whatever the dtype
    # Each expert (and shared expert): act(gate x) * up x when gated (SiLU: Mixtral, Qwen,
    # DeepSeek), else act(up x) (NemotronH's relu²); gpt-oss's "swiglu_oai" is
    # (clamp(up) + 1) * g * sigmoid(alpha g), g = gate clamped to swiglu_limit from above.
    gated: bool = True
    activation: str = "silu"  # or "relu2", "swiglu_oai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss: the router and every expert's projections carry biases.
    router_bias: bool = False
    expert_bias: bool = False
    # How a checkpoint stacks every expert in one tensor: "rows" ([E, 2I, H] gate then up
    # rows, [E, H, I]) or gpt-oss's ("gpt_oss": [E, H, 2I] with gate and up columns
    # interleaved, [E, I, H]).
    stacked_layout: str = "rows"
    # NemotronH: the experts work in a latent of this width, projected in and out (0: none);
    # those projections and its shared experts carry biases when its mlp_bias says.
    latent_size: int = 0
    mlp_bias: bool = False

    def placement(self, tp_size: int, rank: int, expert_parallel: bool) -> ExpertShard:
        """Which experts, and which slice of each, ``rank`` holds: with expert parallelism
        whole experts (``num_experts / tp_size`` each), else a ``1 / tp_size`` slice of every
        expert's intermediate dimension. Refused by name when it cannot be split so."""
        if expert_parallel:
            if self.num_experts % tp_size:
                raise UnsupportedModelError(
                    f"--enable-expert-parallel needs num_experts={self.num_experts} divisible "
                    f"by tensor parallel size {tp_size}; choose a size that divides it, or "
                    "split every expert across the ranks (without the flag)."
                )
            per_rank = self.num_experts // tp_size
            return ExpertShard(rank * per_rank, per_rank, 0, self.intermediate_size)
        if self.intermediate_size % tp_size:
            raise UnsupportedModelError(
                f"moe_intermediate_size={self.intermediate_size} is not divisible by tensor "
                f"parallel size {tp_size}; choose a size that divides it"
                + (", or --enable-expert-parallel." if self.num_experts % tp_size == 0 else ".")
            )
        per_rank = self.intermediate_size // tp_size
        return ExpertShard(0, self.num_experts, rank * per_rank, per_rank)


class ExpertShard(msgspec.Struct, frozen=True, array_like=True):
    """What one rank holds of one MoE layer's experts: experts [first, first + count), and
    of each, intermediate rows [start, start + size)."""

    first_expert: int
    num_experts: int
    intermediate_start: int
    intermediate_size: int


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float | None = None  # None: the family's attention has no rotary embedding
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises each query and key head before RoPE
    # The module holding a layer's attention in the checkpoint (NemotronH's is "mixer"), and
    # so in its cache layer's name: model.layers.N.<module>.attn.
    attention_module: str = "self_attn"
    # One entry per layer: "full_attention" or "sliding_attention"; hybrids also "mamba" and
    # "mlp" (a layer that is only an MLP block); DeepSeek "mla_attention".
    layer_types: tuple[str, ...] = ()
    mamba: MambaConfig | None = None  # hybrids only
    mla: MLAConfig | None = None  # DeepSeek-V2/V3: every attention layer is "mla_attention"
    moe: MoEConfig | None = None  # sparse models: which layers route tokens to experts
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"
    # generation_config.json's sampling defaults under SamplingParams' names (temperature, top_p,
    # top_k, max_tokens), for the fields a request leaves unset.
    default_sampling: dict[str, float | int] = {}

    def is_sliding(self, layer_index: int) -> bool:
        return self.layer_types[layer_index] == "sliding_attention"

    def is_moe(self, layer_index: int) -> bool:
        return self.moe is not None and layer_index in self.moe.layers


def common_fields(raw: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every family reads from config.json and generation_config.json
    alike."""
    return {
        "architecture": raw["architectures"][0],
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "eos_token_ids": eos_token_ids(raw, generation),
        "bos_token_id": raw.get("bos_token_id"),
        "dtype": checkpoint_dtype(raw),
        "default_sampling": default_sampling(generation),
    }


def eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """config.json's end-of-sequence ids, then generation_config.json's others (an instruct
    model's end-of-turn token often lives only there)."""
    ids = _ids(raw.get("eos_token_id"))
    return ids + tuple(i for i in _ids(generation.get("eos_token_id")) if i not in ids)


def checkpoint_dtype(raw: dict[str, Any]) -> str:
    name = str(raw.get("dtype") or raw.get("torch_dtype"))
    return name if name in MODEL_DTYPES else "float32"


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def default_sampling(generation: dict[str, Any]) -> dict[str, float | int]:
    """generation_config.json's sampling values, named as SamplingParams names them.
    ``do_sample: false`` means greedy: transformers then ignores temperature, top_p, top_k."""
    is_greedy = generation.get("do_sample") is False
    fields = {"max_new_tokens": ("max_tokens", int)}
    if not is_greedy:
        fields |= {"temperature": ("temperature", float), "top_p": ("top_p", float)}
        fields |= {"top_k": ("top_k", int)}
    defaults = {
        ours: cast(generation[name])
        for name, (ours, cast) in fields.items()
        if generation.get(name) is not None
    }
    return (defaults | {"temperature": 0.0}) if is_greedy else defaults


def rope_settings(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """The RoPE base and, for a scaled RoPE, its parameters (refused by name when unknown)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"Unsupported RoPE type {rope_type!r}. Supported RoPE types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # transformers lets a top-level original_max_position_embeddings win (Phi-3 writes it there).
    max_len = raw.get("max_position_embeddings", 2048)
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", max_len
    )
    required = ("factor", "low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ()
    missing = [key for key in required if params.get(key) is None]
    if missing:
        raise UnsupportedModelError(f"RoPE type {rope_type!r} needs {', '.join(missing)}")
    factor = params.get("factor") or max_len / original  # yarn may leave it to the lengths
    optional = ("low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim")
    optional += ("attention_factor", "truncate")
    known = {key: params[key] for key in optional if params.get(key) is not None}
    # transformers reads ``beta_fast or 32``: a zero means the default too.
    known |= {key: params[key] for key in ("beta_fast", "beta_slow") if params.get(key)}
    scaling = RopeScaling(
        rope_type=rope_type, factor=factor, original_max_position_embeddings=original, **known
    )
    return theta, scaling
