"""What a kind of cache layer declares about itself (torch-free: the controller plans from it
with no model loaded): the layer types of a config it serves, the spec each such layer gets,
how tensor parallelism splits its state, whether its pages may split into kernel blocks, its
step builder (``workers.group_step``, run in the worker) and its kernel backend family."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from kvcore import KVCacheSpec
from workers.model_config import ModelConfig


@dataclass(frozen=True)
class StateCaching:
    """How recurrent states feed the prefix cache: a state every ``interval`` tokens (their
    groups' block size, kvcore's "align" mode), every boundary a step crosses checkpointed, so
    a step of ``max_num_batched_tokens`` tokens may save that many over ``interval`` states on
    top of the current one and its copy source. Without it (prefix caching off) each request
    holds one state and never hits."""

    interval: int
    max_num_batched_tokens: int

    @property
    def num_checkpoints(self) -> int:
        return -(-self.max_num_batched_tokens // self.interval)


@dataclass(frozen=True)
class SpecContext:
    """What a spec factory reads: the model, and how this engine caches and shards it."""

    config: ModelConfig
    block_size: int
    dtype: str  # attention caches' (--kv-cache-dtype)
    tp_size: int
    state_caching: StateCaching | None
    # Recurrent states' (Mamba's conv state): the dtype the model runs in, which its layers
    # read and write them in, whatever the attention caches are stored as.
    state_dtype: str
    # Drafts a request may carry into one step: a recurrent layer keeps the state after each
    # one beside its own (a rejected draft's successor state), 0 when not speculating.
    num_speculative_tokens: int = 0


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class CacheKind:
    name: str
    layer_types: tuple[str, ...]  # the config's ``layer_types`` entries this kind serves
    spec_types: tuple[type[KVCacheSpec], ...]  # the kvcore specs its layers get
    layer_name: Callable[[ModelConfig, int], str]  # (config, layer index) -> its cache's name
    layer_spec: Callable[[SpecContext, int], KVCacheSpec]  # -> the layer's global spec
    step_builder: str  # "module:Class" of its GroupStepBuilder (imported in the worker)
    # Per state of the spec, the axis tensor parallelism splits (None: kvcore's head sharding).
    state_head_axes: tuple[int, ...] | None = None
    splits_into_kernel_blocks: bool = True  # a recurrent state is one page, never split

    def builder_class(self):
        return _load(self.step_builder)
