"""Random-weight checkpoints written by transformers, for ``kvray bench make-*``: kvray
(``--model DIR``) and transformers (``from_pretrained``) then load the same files, with nothing
downloaded."""

from __future__ import annotations

from pathlib import Path


def save_random_checkpoint(directory: str | Path, family: str, config: dict, seed: int) -> int:
    """Write transformers' ``{family}ForCausalLM`` built from ``{family}Config(**config)`` with
    seeded random weights to ``directory``; returns its number of parameters."""
    import torch

    try:
        import transformers

        config_class = getattr(transformers, f"{family}Config")
        model_class = getattr(transformers, f"{family}ForCausalLM")
    except (ImportError, AttributeError):
        raise ValueError(
            f"This checkpoint is built with transformers' {family} (pip install 'transformers>=5')"
        ) from None
    torch.manual_seed(seed)
    model = model_class(config_class(**config)).eval()
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())
