"""``kvray bench make-hybrid DIR``: a random-weight NemotronH checkpoint of about 18M
parameters, written by transformers, so kvray (``--model DIR``) and transformers
(``from_pretrained``) load the same files with nothing downloaded.

It is the hybrid sibling of ``embedded:20m`` (18.0M parameters, six attention layers): the
same width, vocabulary (the byte tokenizer's 258 ids, so token-id prompts of either model fit
the other) and attention geometry, with the layers of a real NemotronH in miniature: mostly
Mamba-2 (``M``) and relu² MLP (``-``) layers, two attention layers (``*``). The directory has
no tokenizer.json: kvray serves it token-id prompts only.
"""

from __future__ import annotations

from pathlib import Path

from cluster.bench.random_checkpoint import save_random_checkpoint
from workers.tokenizer import ByteTokenizer

# Twelve layers: six Mamba, four MLP, two attention, the order of NemotronH-8B's pattern.
DEFAULT_PATTERN = "M-M*M-M-M*M-"
PATTERN_LETTERS = ("M", "*", "-")  # Mamba-2, attention, MLP (MoE layers are not served)

# NemotronH-8B's proportions at hidden size 512: Mamba heads of 64 channels making twice the
# hidden size, a 128-wide SSM state, chunks of 128 tokens; embedded:20m's attention (8 query
# and 4 KV heads of 64) so a context token costs both models the same per attention layer.
HYBRID_20M = dict(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=512,
    intermediate_size=1280,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    mamba_num_heads=16,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=2,
    conv_kernel=4,
    chunk_size=128,
    max_position_embeddings=8192,
    bos_token_id=ByteTokenizer.BOS,
    eos_token_id=ByteTokenizer.EOS,
    # No padding id: transformers would zero that token's embedding, and random prompts may
    # hold any id (the baseline passes its own pad id with an explicit attention mask).
    pad_token_id=None,
    tie_word_embeddings=False,
)


def save_hybrid_checkpoint(directory: str | Path, pattern: str = DEFAULT_PATTERN, seed: int = 0):
    """Write the checkpoint (config.json, generation_config.json, safetensors) to
    ``directory``; returns its number of parameters. Needs transformers."""
    if not pattern or set(pattern) - set(PATTERN_LETTERS):
        raise ValueError(
            f"--pattern {pattern!r}: one letter a layer, each of {', '.join(PATTERN_LETTERS)}"
        )
    return save_random_checkpoint(
        directory, "NemotronH", HYBRID_20M | {"hybrid_override_pattern": pattern}, seed
    )
