"""Pipeline stages: which decoder layers a worker owns.

A model of L decoder layers served in P stages gives each stage a contiguous run of layers.
The first stage also holds the token embedding, the last the final norm, the LM head and
sampling (and, when the head is the embedding, a copy of that matrix). Hidden states travel
from one stage to the next; every stage keeps the cache of its own layers only.

An even split is the default: L // P layers each, and the L % P layers left over go one each
to the stages before the last, nearest it first (the last already holds the head).
A partition ("a,b,...": ``--pp-layer-partition`` or ``KVRAY_PP_LAYER_PARTITION``) names every
stage's count instead.
"""

from __future__ import annotations

import re

import msgspec

PARTITION = "--pp-layer-partition"  # and KVRAY_PP_LAYER_PARTITION
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class StagePartitionError(ValueError):
    """The stages asked for cannot divide the model's layers."""


class PipelineStage(msgspec.Struct, frozen=True):
    """Stage ``index`` of ``count``: decoder layers ``start`` up to ``end`` of
    ``num_layers``."""

    index: int
    count: int
    start: int
    end: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The one stage of a model served without pipeline parallelism."""
        return cls(index=0, count=1, start=0, end=num_layers, num_layers=num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def is_whole(self) -> bool:
        return self.count == 1

    def holds_embedding(self, tied: bool) -> bool:
        """The first stage embeds the tokens; the last keeps the matrix too when the LM head
        is the embedding (``tied``)."""
        return self.is_first or (self.is_last and tied)

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


def split_layers(num_layers: int, count: int, partition: str | None = None) -> list[PipelineStage]:
    """The ``count`` stages of a model with ``num_layers`` decoder layers: an even split, or
    the per-stage counts of ``partition`` ("a,b,...")."""
    if count < 1:
        raise StagePartitionError(f"--pipeline-parallel-size must be at least 1, not {count}.")
    if partition is None:
        sizes = _even_sizes(num_layers, count)
    else:
        sizes = _parsed_sizes(partition, num_layers, count)
    stages, start = [], 0
    for index, size in enumerate(sizes):
        stages.append(PipelineStage(index, count, start, start + size, num_layers))
        start += size
    return stages


def _even_sizes(num_layers: int, count: int) -> list[int]:
    if count > num_layers:
        raise StagePartitionError(
            f"--pipeline-parallel-size {count} asks for more stages than the model has decoder "
            f"layers ({num_layers}): every stage needs at least one."
        )
    sizes = [num_layers // count] * count
    for extra in range(num_layers % count):
        sizes[count - 2 - extra] += 1
    return sizes


def _parsed_sizes(partition: str, num_layers: int, count: int) -> list[int]:
    parts = [p.strip() for p in partition.split(",")]
    if not all(re.fullmatch(r"\d+", p) for p in parts):
        raise StagePartitionError(
            f"{PARTITION} {partition!r} is not a comma-separated list of layer counts."
        )
    sizes = [int(p) for p in parts]
    if len(sizes) != count:
        raise StagePartitionError(
            f"{PARTITION} {partition!r} names {len(sizes)} stage(s), but "
            f"--pipeline-parallel-size is {count}."
        )
    if min(sizes) < 1:
        raise StagePartitionError(
            f"{PARTITION} {partition!r} leaves a stage without layers: every stage needs "
            "at least one."
        )
    if sum(sizes) != num_layers:
        raise StagePartitionError(
            f"{PARTITION} {partition!r} sums to {sum(sizes)} layers; the model has "
            f"{num_layers} decoder layers."
        )
    return sizes


def left_out(name: str, stage: PipelineStage, held: dict[str, bool]) -> bool:
    """Whether parameter ``name`` belongs to a part of the model this stage does not hold:
    another stage's decoder layer, or a module (by name prefix in ``held``) that is not on
    this stage. Layers past the decoder's (draft layers some checkpoints carry) are left to
    the family's own rules."""
    layer = _LAYER.match(name)
    if layer is not None:
        index = int(layer.group(1))
        return index < stage.num_layers and not stage.owns(index)
    return any(name.startswith(prefix) and not here for prefix, here in held.items())
