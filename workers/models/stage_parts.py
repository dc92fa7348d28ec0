"""What a causal LM holds by its pipeline stage, the same in every family: the LM head on the
last stage (the embedding's matrix when the two are tied), and which checkpoint tensors are
other stages'."""

from __future__ import annotations

import torch
from torch import nn

from workers.layers.embedding import ParallelLMHead
from workers.model_config import ModelConfig
from workers.stages import PipelineStage, left_out


def stage_lm_head(
    config: ModelConfig, dtype: torch.dtype, stage: PipelineStage, embedding: nn.Module | None
) -> ParallelLMHead | None:
    if not stage.is_last:
        return None
    head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype)
    if config.tie_word_embeddings:
        head.weight = embedding.weight
    return head


def other_stages_parameter(
    name: str, stage: PipelineStage, config: ModelConfig, embedding: str, norm: str
) -> bool:
    """Whether parameter ``name`` is another stage's (``embedding`` and ``norm``: the name
    prefixes of the family's token embedding and final norm)."""
    held = {
        embedding: stage.holds_embedding(config.tie_word_embeddings),
        norm: stage.is_last,
        "lm_head.": stage.is_last,
    }
    return left_out(name, stage, held)
