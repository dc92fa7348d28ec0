"""GGUF files (llama.cpp's format): the model config their metadata describes, their weights
dequantized tensor by tensor under Hugging Face names, and the tokenizer their metadata spells.

Only Llama-architecture files are served. llama.cpp's converter reorders the rows of each Q and
K head for its RoPE (rotate-half pairs become interleaved pairs); ``_unpermute_rope`` restores
the Hugging Face order, as transformers' GGUF loader does. The ``gguf`` package is imported
where a file is read, so the rest of kvray does not pay for it.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from kernels.quant.gguf_blocks import QuantizedMatrix
from workers.loader import CheckpointError, load_named_tensors
from workers.model_config import ModelConfig, UnsupportedModelError

# GGUF architecture -> the Hugging Face architecture kvray serves it as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# Per-layer GGUF tensor names -> Hugging Face names (under ``model.layers.N.``).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFMetadata:
    values: dict[str, Any]  # every key-value pair, as Python values
    tensors: dict[str, tuple[int, ...]]  # name -> shape in PyTorch order (rows first)
    types: dict[str, str]  # name -> storage type: "F32", "Q4_1", ...

    @property
    def tensor_types(self) -> frozenset[str]:
        return frozenset(self.types.values())

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.values['general.architecture']}.{key}", default)


def find_gguf_file(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: a ``.gguf`` file, or the one ``.gguf`` in a directory
    without a ``config.json``; None for anything else (a Hugging Face directory)."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"No GGUF file {model}")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"{model} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
            "pass the one to serve as --model DIR/FILE.gguf (split GGUFs are not supported)"
        )
    return files[0] if files else None


@functools.lru_cache(maxsize=4)
def read_metadata(path: Path) -> GGUFMetadata:
    """The file's metadata and tensor shapes, read once per process (the token list makes
    reading take seconds)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    values = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return GGUFMetadata(values, tensors, types)


def gguf_model_config(path: Path) -> ModelConfig:
    """The model config a GGUF's ``llama.*`` metadata describes; refuses what kvray would
    serve wrongly (another architecture, RoPE scaling, partial rotary)."""
    meta = read_metadata(path)
    architecture = meta.values.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"Unsupported GGUF architecture {architecture!r}. Supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    _refuse_rope_scaling(meta)
    hidden = meta.arch_value("embedding_length")
    num_heads = meta.arch_value("attention.head_count")
    head_dim = meta.arch_value("attention.key_length") or hidden // num_heads
    if meta.arch_value("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError("RoPE over part of each head is not supported")
    num_kv_heads = meta.arch_value("attention.head_count_kv") or num_heads
    if not isinstance(num_kv_heads, int):
        raise UnsupportedModelError("A number of KV heads per layer is not supported")
    num_layers = meta.arch_value("block_count")
    tokens = meta.values.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else meta.arch_value("vocab_size")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[architecture],
        vocab_size=vocab_size or meta.tensors["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=meta.arch_value("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.arch_value("rope.freq_base", 10000.0)),
        max_position_embeddings=meta.arch_value("context_length", 2048),
        tie_word_embeddings="output.weight" not in meta.tensors,
        qkv_bias="blk.0.attn_q.bias" in meta.tensors,
        o_proj_bias="blk.0.attn_output.bias" in meta.tensors,
        mlp_bias="blk.0.ffn_up.bias" in meta.tensors,
        layer_types=("full_attention",) * num_layers,
        eos_token_ids=_stop_token_ids(meta),
        bos_token_id=meta.values.get("tokenizer.ggml.bos_token_id"),
        dtype=_float_dtype(meta.tensor_types),
    )


def _refuse_rope_scaling(meta: GGUFMetadata) -> None:
    scaling = meta.arch_value("rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in meta.tensors:
        kind = scaling if scaling != "none" else "llama3 (rope_freqs)"
        raise UnsupportedModelError(
            f"Unsupported RoPE scaling {kind!r} in the GGUF. Supported RoPE types: default"
        )


def _stop_token_ids(meta: GGUFMetadata) -> tuple[int, ...]:
    """End of sequence, and end of turn / of message where the file names them (llama.cpp
    stops on each)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = (meta.values.get(f"tokenizer.ggml.{key}") for key in keys)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _float_dtype(types: frozenset[str]) -> str:
    """The serving dtype a file implies: its half type when it holds plain floats (its F32
    tensors are the norms), float32 for an all-F32 file, bfloat16 for quantized blocks."""
    if types <= {"F32", "F16", "BF16"}:
        return "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"
    return "bfloat16"


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when kvray has no such tensor."""
    stem, _, kind = name.rpartition(".")
    if stem in MODEL_TENSORS and kind in ("weight", "bias"):
        return f"{MODEL_TENSORS[stem]}.{kind}"
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Put each Q/K head's rows back in Hugging Face's order. llama.cpp's RoPE rotates adjacent
    pairs of rows where Hugging Face's rotates row i with row i + D/2, so its converter stores
    a head's rows in the order 0, D/2, 1, D/2 + 1, ... of Hugging Face's."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [H*D, ...] -> [H, D/2, 2, ...] -> [H, 2, D/2, ...] -> [H*D, ...]
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def iterate_gguf_weights(
    path: Path, config: ModelConfig, keep_quantized: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor | QuantizedMatrix]]:
    """(Hugging Face name, weight) for every tensor: a ``QuantizedMatrix`` of the file's blocks
    for the tensors named in ``keep_quantized``, a float32 tensor for the others, dequantized
    one at a time so at most one full tensor is held beside the model."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in GGUFReader(path).tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise CheckpointError(f"Unexpected tensor {tensor.name!r} in the GGUF file")
        part = tensor.name.split(".")[-2]
        if tensor.name in keep_quantized:
            blocks = QuantizedMatrix.from_gguf(tensor.tensor_type.name, tensor.data)
            if part in heads:
                order = _unpermute_rope(torch.arange(blocks.shape[0]), heads[part])
                blocks = blocks.index_rows(order)
            yield name, blocks
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"Tensor {tensor.name!r}: cannot dequantize {tensor.tensor_type.name} ({exc})"
            ) from exc
        values = np.asarray(values, dtype=np.float32)
        if not values.flags.writeable:  # F32 tensors are views of the read-only file map
            values = values.copy()
        weight = torch.from_numpy(values)
        if part in heads:
            weight = _unpermute_rope(weight, heads[part])
        yield name, weight


def load_gguf_weights(
    model: nn.Module,
    path: Path,
    *,
    keep_quantized: Collection[str] = (),
    show_progress: bool = True,
) -> None:
    """Fill every parameter of ``model`` from a GGUF through the checkpoint loaders: each
    tensor (dequantized to float32, or its blocks for those in ``keep_quantized``) is handed to
    its loader, which keeps this rank's slice, and dropped before the next."""
    entries = tqdm(
        iterate_gguf_weights(path, model.config, keep_quantized),
        desc="Loading GGUF weights",
        unit="tensor",
        total=len(read_metadata(path).tensors),
        disable=not show_progress,
        file=sys.stderr,
    )
    load_named_tensors(model, entries)


# -- the tokenizer ---------------------------------------------------------------------------

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# How text is split before byte-level BPE, by ``tokenizer.ggml.pre``; GPT-2's split otherwise.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}


@dataclass(frozen=True)
class GGUFTokenizerParts:
    tokenizer: Any  # a tokenizers.Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> the token's text
    chat_template: str | None


@functools.cache
def _byte_alphabet() -> tuple[str, ...]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others for code points 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(extra)) for b in range(256))


def build_tokenizer(path: Path) -> GGUFTokenizerParts:
    """The byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) a GGUF spells, built
    as transformers' GGUF converter builds it, so both encode and decode alike."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    values = read_metadata(path).values
    kind = values.get("tokenizer.ggml.model")
    if kind is None:
        raise UnsupportedModelError("This GGUF has no tokenizer (no tokenizer.ggml.model)")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"Unsupported GGUF tokenizer {kind!r}. Supported: gpt2 (byte-level BPE)"
        )
    tokens: list[str] = values["tokenizer.ggml.tokens"]
    alphabet = _byte_alphabet()
    letters = set(alphabet)
    # A token spelled outside the byte alphabet (rare) is respelled byte by byte.
    vocab = {
        token if set(token) <= letters else "".join(alphabet[b] for b in token.encode()): i
        for i, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in values.get("tokenizer.ggml.merges", ())]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(values.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    special_tokens = {
        name: tokens[values[f"tokenizer.ggml.{key}"]]
        for name, key in SPECIAL_TOKEN_KEYS.items()
        if f"tokenizer.ggml.{key}" in values
    }
    types = values.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # 1: normal
    # Control tokens (a mislabelled one outside the byte alphabet aside) and the named special
    # tokens stay whole and are skipped when decoding; user-defined ones stay whole only.
    special = [
        t for t, tt in zip(tokens, types, strict=True) if tt == CONTROL and set(t) <= letters
    ]
    special += [t for t in special_tokens.values() if t in vocab and t not in special]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    added = [t for t, tt in zip(tokens, types, strict=True) if tt == USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    _add_bos_eos(tokenizer, values)
    return GGUFTokenizerParts(tokenizer, special_tokens, values.get("tokenizer.chat_template"))


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_bos_eos(tokenizer, values: dict[str, Any]) -> None:
    """BOS / EOS around every encoding where the file asks for them (llama.cpp adds them)."""
    from tokenizers import processors

    ends = [
        values.get(f"tokenizer.ggml.{key}_token_id")
        if values.get(f"tokenizer.ggml.add_{key}_token")
        else None
        for key in ("bos", "eos")
    ]
    if ends == [None, None]:
        return
    bos, eos = (None if i is None else values["tokenizer.ggml.tokens"][i] for i in ends)
    template = [*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(template),
        special_tokens=[(t, i) for t, i in zip((bos, eos), ends, strict=True) if t is not None],
    )
