"""Every model family kvray serves, in one table: Hugging Face architecture name -> the
family's config parser (beside its model, torch-free) and its model class (imported only when
a worker builds the model, since it needs torch). Adding a family is its config parser, its
model file and one entry here."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.model_config import ModelConfig, UnsupportedModelError
from workers.models.deepseek_config import ARCHITECTURES as DEEPSEEK
from workers.models.deepseek_config import parse_deepseek
from workers.models.gpt_oss_config import ARCHITECTURES as GPT_OSS
from workers.models.gpt_oss_config import parse_gpt_oss
from workers.models.llama_config import ARCHITECTURES as LLAMA
from workers.models.llama_config import parse_llama
from workers.models.nemotron_h_config import parse_nemotron_h

ConfigParser = Any  # (config.json, generation_config.json) -> ModelConfig


@dataclass(frozen=True)
class Family:
    parse: ConfigParser
    model_class: str  # "module:Class"


_LLAMA = Family(parse_llama, "workers.models.llama:LlamaForCausalLM")
_DEEPSEEK = Family(parse_deepseek, "workers.models.deepseek:DeepseekForCausalLM")
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(LLAMA, _LLAMA),
    # hybrid: Mamba-2, attention and MLP layers
    "NemotronHForCausalLM": Family(
        parse_nemotron_h, "workers.models.nemotron_h:NemotronHForCausalLM"
    ),
    # multi-head latent attention, dense or MoE MLPs
    **dict.fromkeys(DEEPSEEK, _DEEPSEEK),
    # attention sinks, MoE in every layer
    **dict.fromkeys(GPT_OSS, Family(parse_gpt_oss, "workers.models.gpt_oss:GptOssForCausalLM")),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_of(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise UnsupportedModelError(
            f"Unsupported architecture {architecture!r}. Supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return FAMILIES[architecture]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"No config.json in model directory {model_dir}")
    generation_path = Path(model_dir) / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    return parse_hf_config(json.loads(path.read_text()), generation)


def parse_hf_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """``raw`` is config.json; ``generation`` generation_config.json, when there is one."""
    architectures = raw.get("architectures") or []
    family = family_of(architectures[0] if architectures else "<none>")
    _refuse_quantized(raw)
    return family.parse(raw, generation or {})


def model_class_for(config: ModelConfig) -> type:
    module, name = family_of(config.architecture).model_class.split(":")
    return getattr(importlib.import_module(module), name)


def _refuse_quantized(raw: dict[str, Any]) -> None:
    quantization = raw.get("quantization_config")
    if not quantization:
        return
    method = (
        quantization.get("quant_method", "unknown")
        if isinstance(quantization, dict)
        else quantization
    )
    raise UnsupportedModelError(
        f"Quantized checkpoints are not served yet (quantization_config: {method}); use "
        "an unquantized (bfloat16, float16 or float32) checkpoint of the model"
    )
