"""Every error kvcore raises on purpose. All are ``ValueError``s, so callers that only care
that an input was refused can catch one type, and callers that care why can be precise."""

from __future__ import annotations


class KVCacheSpecError(ValueError):
    """A spec's own fields are inconsistent (a negative head count, a padded page that is
    smaller than the content, a block that is not a whole number of states, ...)."""


class KVCacheSpecMergeError(KVCacheSpecError):
    """Specs that were asked to share one KV-cache group cannot be merged."""


class KVCacheLayoutError(ValueError):
    """An unknown layout name, or a layout that cannot express the requested geometry."""


class KVCacheGeometryError(ValueError):
    """Shape, stride or view arithmetic was asked for something it cannot express."""


class WireFormatError(ValueError):
    """Bytes that do not decode to the expected kvcore message."""


class TensorParallelError(ValueError):
    """A layer's geometry cannot be split over the requested tensor-parallel size."""


class GeometryMismatchError(ValueError):
    """One rank's reported KV geometry differs from what the model config and TP size imply.

    ``rank``, ``layer`` and ``field`` locate the difference; ``expected`` and ``reported`` are
    the two values. ``layer`` is None when the difference is about the rank set itself.
    """

    def __init__(
        self, *, rank: int, layer: str | None, field: str, expected: object, reported: object
    ) -> None:
        self.rank = rank
        self.layer = layer
        self.field = field
        self.expected = expected
        self.reported = reported
        where = f"rank {rank}" if layer is None else f"rank {rank}, layer '{layer}'"
        super().__init__(
            f"KV geometry mismatch at {where}: field '{field}' expected {expected!r}, "
            f"reported {reported!r}."
        )
