"""The startup check that every rank's KV geometry is what the model config and TP size imply.

The controller runs it on the decoded rank reports before planning. A mismatch means two ranks
would disagree about what a block id addresses, so it is refused with the first differing
(rank, layer, field) and both values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvcore.errors import GeometryMismatchError
from kvcore.sharding import shard_layer_specs
from kvcore.spec_base import KVCacheSpec
from kvcore.wire import RankReport

SpecHook = Callable[[KVCacheSpec], KVCacheSpec]


def check_rank_reports(
    reports: Sequence[RankReport],
    global_specs: Mapping[str, KVCacheSpec],
    tp_size: int,
    *,
    customize_spec: SpecHook | None = None,
    state_head_axes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, KVCacheSpec]:
    """Raise ``GeometryMismatchError`` unless every rank 0..tp_size-1 reported exactly once and
    each rank's specs equal the global specs sharded for it (then passed through the backend's
    ``customize_spec``). Returns the agreed per-rank specs, in layer order."""
    _check_rank_set(reports, tp_size)
    expected_per_rank = {}
    for report in sorted(reports, key=lambda r: r.rank):
        expected = shard_layer_specs(
            global_specs, tp_size, report.rank, state_head_axes=state_head_axes
        )
        if customize_spec is not None:
            expected = {name: customize_spec(spec) for name, spec in expected.items()}
        _check_layers(report, expected)
        expected_per_rank[report.rank] = expected
    return expected_per_rank[0]


def _check_rank_set(reports: Sequence[RankReport], tp_size: int) -> None:
    seen: set[int] = set()
    for report in reports:
        if report.rank >= tp_size or report.rank in seen:
            why = "duplicate" if report.rank in seen else f"outside 0..{tp_size - 1}"
            raise GeometryMismatchError(
                rank=report.rank,
                layer=None,
                field="rank",
                expected=f"unique rank < {tp_size}",
                reported=f"{report.rank} ({why})",
            )
        seen.add(report.rank)
    missing = sorted(set(range(tp_size)) - seen)
    if missing:
        raise GeometryMismatchError(
            rank=missing[0], layer=None, field="rank", expected="a report", reported="none"
        )


def _check_layers(report: RankReport, expected: Mapping[str, KVCacheSpec]) -> None:
    for layer_name in expected:
        if layer_name not in report.specs:
            raise GeometryMismatchError(
                rank=report.rank,
                layer=layer_name,
                field="layer",
                expected="present",
                reported="missing",
            )
    for layer_name, spec in report.specs.items():
        if layer_name not in expected:
            raise GeometryMismatchError(
                rank=report.rank,
                layer=layer_name,
                field="layer",
                expected="absent (not in the model config)",
                reported=type(spec).__name__,
            )
        _check_spec(report.rank, layer_name, expected[layer_name], spec)


def _check_spec(rank: int, layer_name: str, expected: KVCacheSpec, reported: KVCacheSpec) -> None:
    if type(expected) is not type(reported):
        raise GeometryMismatchError(
            rank=rank,
            layer=layer_name,
            field="type",
            expected=type(expected).__name__,
            reported=type(reported).__name__,
        )
    for field in type(expected).__struct_fields__:
        want, got = getattr(expected, field), getattr(reported, field)
        if want != got:
            raise GeometryMismatchError(
                rank=rank, layer=layer_name, field=field, expected=want, reported=got
            )
