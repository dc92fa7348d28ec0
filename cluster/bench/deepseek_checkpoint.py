"""``kvray bench make-deepseek DIR``: a random-weight dense DeepSeek-V3 checkpoint of about 16M
parameters (multi-head latent attention in every layer), written by transformers.

The MLA sibling of ``embedded:20m`` and ``make-hybrid``: the same width and vocabulary (the
byte tokenizer's 258 ids), with DeepSeek-V3's attention in miniature (a 128-value latent plus
a 32-value rope key per token, nope and value heads of 64, ``q_lora_rank`` 192, interleaved
RoPE) and dense SiLU MLPs in every layer (MoE layers are not served). The directory has no
tokenizer.json: kvray serves it token-id prompts only.
"""

from __future__ import annotations

from pathlib import Path

from cluster.bench.random_checkpoint import save_random_checkpoint
from workers.tokenizer import ByteTokenizer

DEFAULT_LAYERS = 6
DEFAULT_Q_LORA_RANK = 192

# DeepSeek-V3's proportions at hidden size 512 (its 7168 / 14): 8 heads, latent 128 (512/4),
# rope 32, nope and value 64, a q_lora_rank of 3/8 the hidden size.
DEEPSEEK_16M = dict(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=512,
    intermediate_size=1280,
    num_attention_heads=8,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    max_position_embeddings=8192,
    bos_token_id=ByteTokenizer.BOS,
    eos_token_id=ByteTokenizer.EOS,
    pad_token_id=None,  # transformers would zero that id's embedding in prompts
    tie_word_embeddings=False,
)


def save_deepseek_checkpoint(
    directory: str | Path,
    num_layers: int = DEFAULT_LAYERS,
    q_lora_rank: int | None = DEFAULT_Q_LORA_RANK,
    seed: int = 0,
) -> int:
    """Write the checkpoint to ``directory``; returns its number of parameters. Every layer is
    dense (``first_k_dense_replace = num_hidden_layers``). Needs transformers."""
    if num_layers < 1:
        raise ValueError(f"--layers must be at least 1, got {num_layers}")
    layers = dict(num_hidden_layers=num_layers, first_k_dense_replace=num_layers)
    config = DEEPSEEK_16M | layers | {"q_lora_rank": q_lora_rank}
    return save_random_checkpoint(directory, "DeepseekV3", config, seed)
