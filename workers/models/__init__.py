"""Model families kvray serves, by Hugging Face architecture name."""

from __future__ import annotations

from workers.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError


def model_class_for(config: ModelConfig):
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"Unsupported architecture {config.architecture!r}. Supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if config.architecture == "NemotronHForCausalLM":
        from workers.models.nemotron_h import NemotronHForCausalLM

        return NemotronHForCausalLM
    if config.mla is not None:
        from workers.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    from workers.models.llama import LlamaForCausalLM  # every other family shares it

    return LlamaForCausalLM
