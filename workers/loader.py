"""Loading a Hugging Face checkpoint (``*.safetensors``, optionally sharded with
``model.safetensors.index.json``) into a model, reading only this rank's slices.

Every parameter's ``weight_loader`` receives a lazy handle with ``shape`` and
``narrow(dim, start, length)``, so a rank reads the bytes of its own shard and no more.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm


class CheckpointError(ValueError):
    """The checkpoint does not match the model: a missing, unexpected or misshapen tensor."""


class LazyTensor:
    """One checkpoint tensor, read from disk only where it is narrowed."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"No *.safetensors files in {model_dir}")
    return files


def iterate_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, LazyTensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, LazyTensor(handle, name)


def _target(model: nn.Module, name: str) -> tuple[str, object]:
    """Our parameter name for a checkpoint tensor, and the shard id when it is packed."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        packed = model.packed_modules.get(part)
        if packed is not None:
            parts[index] = packed[0]
            return ".".join(parts), packed[1]
    return name, None


def load_weights(model: nn.Module, model_dir: str | Path, *, show_progress: bool = True) -> None:
    """Fill every parameter of ``model`` from the checkpoint; refuse on any mismatch."""
    entries = tqdm(
        iterate_checkpoint(model_dir),
        desc="Loading weights",
        unit="tensor",
        disable=not show_progress,
        file=sys.stderr,
    )
    load_named_tensors(model, entries)


def load_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` from full tensors in memory, through the same per-rank loaders."""
    load_named_tensors(model, tensors.items())


def is_skipped(model: nn.Module, name: str) -> bool:
    """Checkpoint tensors no parameter takes: derived buffers, and a head that is the
    embedding."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def parameter_target(model: nn.Module, name: str) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills, and the part of it (None: the whole)."""
    # A family loading some tensors in parts (experts) says which parameter and part ...
    special = getattr(model, "checkpoint_target", None)
    target = None if special is None else special(name)
    if target is not None:
        return target
    # ... and one whose checkpoint names differ from its parameters' says how to map them.
    rename = getattr(model, "checkpoint_name", None)
    return _target(model, name if rename is None else rename(name))


def load_named_tensors(model: nn.Module, entries) -> None:
    """``entries`` yields (checkpoint name, tensor or LazyTensor) pairs."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    left_out = getattr(model, "left_out", None)
    for name, tensor in entries:
        if is_skipped(model, name):
            continue
        param_name, shard_id = parameter_target(model, name)
        param = params.get(param_name)
        if param is None and left_out is not None and left_out(param_name):
            continue  # another pipeline stage's
        if param is None:
            raise CheckpointError(
                f"Unexpected tensor {name!r} in the checkpoint: the model has no parameter "
                f"{param_name!r}."
            )
        loader = getattr(param, "weight_loader", _copy_whole)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as exc:
            raise CheckpointError(f"Tensor {name!r}: {exc}") from exc
        loaded.add(param_name if shard_id is None else f"{param_name}#{shard_id}")
    _check_complete(model, params, loaded, tied)


def _copy_whole(param: nn.Parameter, loaded) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded.narrow(0, 0, loaded.shape[0]))


def _check_complete(model, params, loaded: set[str], tied: bool) -> None:
    shards_by_param: dict[str, list[object]] = {}
    for ours, shard in model.packed_modules.values():
        shards_by_param.setdefault(ours, []).append(shard)
    for name, param in params.items():
        if tied and name == "lm_head.weight":
            continue
        expected = getattr(param, "expected_shards", None)
        if expected is not None:  # loaded whole, or every part of it
            missing = [s for s in expected if f"{name}#{s}" not in loaded]
            if name not in loaded and missing:
                raise CheckpointError(f"Missing tensor for {name!r} (part {missing[0]}).")
            continue
        leaf = name.split(".")[-2] if "." in name else name
        shards = shards_by_param.get(leaf)
        if shards is None:
            if name not in loaded:
                raise CheckpointError(f"Missing tensor {name!r} in the checkpoint.")
            continue
        for shard in shards:
            if f"{name}#{shard}" not in loaded:
                original = next(k for k, v in model.packed_modules.items() if v == (leaf, shard))
                raise CheckpointError(
                    f"Missing tensor {name.replace(leaf, original)!r} in the checkpoint."
                )
