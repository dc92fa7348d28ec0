"""The shared-memory collectives of ``kernels/collectives/cpu/shm_collectives.c`` through
ctypes: a region every TP rank of one host maps, and the calls that read and write it. Which
ranks use it, and when gloo serves instead, is ``workers.parallel``'s to decide."""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import subprocess
from pathlib import Path

import torch

from kernels.c_build import build_library

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "shm_collectives.c"
FLAG_STRIDE = 64  # the C file's: one cache line per rank's flag
SLOT_BYTES = 1 << 20  # per rank and set: a decode step's activations; longer sums go in parts
TIMEOUT_S = 300.0  # a rank this late is lost (the controller tears the group down first)
_ptr = ctypes.c_void_p


class _Group(ctypes.Structure):
    _fields_ = [
        ("base", _ptr),
        ("slot_bytes", ctypes.c_int64),
        ("rank", ctypes.c_int),
        ("world", ctypes.c_int),
        ("seq", ctypes.c_int64),
        ("timeout_s", ctypes.c_double),
    ]


@functools.cache
def library():
    """The compiled collectives, or None where they cannot be built here."""
    try:
        lib = ctypes.CDLL(str(build_library(SOURCE)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("Shared-memory collectives unavailable (%s); using gloo", exc)
        return None
    group = ctypes.POINTER(_Group)
    lib.shm_all_reduce_f32.argtypes = [group, _ptr, ctypes.c_int64]
    lib.shm_broadcast.argtypes = [group, _ptr, ctypes.c_int64, ctypes.c_int]
    lib.shm_all_gather.argtypes = [group, _ptr, _ptr, ctypes.c_int64]
    for function in (lib.shm_all_reduce_f32, lib.shm_broadcast, lib.shm_all_gather):
        function.restype = ctypes.c_int
    return lib


def region_bytes(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return world_size * FLAG_STRIDE + 2 * world_size * slot_bytes


def create_region(path: str, world_size: int, slot_bytes: int = SLOT_BYTES) -> None:
    """The zeroed file every rank maps (rank 0 makes it; the flags start at 0), readable by
    this user alone. Its pages are reserved now: a full /dev/shm raises OSError here, where a
    sparse file would kill a rank with SIGBUS at its first collective."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, region_bytes(world_size, slot_bytes))
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class ShmCollectives:
    """This rank's view of a region made by ``create_region``; every rank of the group must
    make the same calls in the same order, as with any collective."""

    def __init__(self, path: str, rank: int, world_size: int, slot_bytes: int = SLOT_BYTES):
        self._lib = library()
        if self._lib is None:
            raise OSError("the shared-memory collectives could not be built")
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), region_bytes(world_size, slot_bytes))
        self._anchor = ctypes.c_char.from_buffer(self._map)  # keeps the map's address fixed
        self._group = _Group(
            base=ctypes.addressof(self._anchor), slot_bytes=slot_bytes, rank=rank,
            world=world_size, seq=0, timeout_s=TIMEOUT_S,
        )  # fmt: skip
        self.slot_bytes = slot_bytes

    def serves(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum float32 ``tensor`` over the ranks, in place, a slot's worth at a time."""
        flat, step = tensor.view(-1), self.slot_bytes // 4
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            self._check(self._lib.shm_all_reduce_f32(self._ref, part.data_ptr(), part.numel()))

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self._check(self._lib.shm_broadcast(self._ref, tensor.data_ptr(), nbytes, root))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all), in rank order."""
        world = self._group.world
        out = torch.empty((world, *tensor.shape), dtype=tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        self._check(self._lib.shm_all_gather(self._ref, tensor.data_ptr(), out.data_ptr(), nbytes))
        return list(out.unbind(0))

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether a broadcast or gather of ``tensor`` fits a slot (a sum always does)."""
        return tensor.numel() * tensor.element_size() <= self.slot_bytes

    def close(self) -> None:
        del self._anchor
        self._map.close()

    @property
    def _ref(self):
        return ctypes.byref(self._group)

    def _check(self, code: int) -> None:
        if code == -1:
            raise RuntimeError(
                f"A tensor-parallel rank did not reach the collective within {TIMEOUT_S:.0f} s"
            )
        if code != 0:
            raise RuntimeError(f"shared-memory collective failed ({code})")


def shm_directory() -> str | None:
    """Where the region file goes: /dev/shm (memory, not disk), when it is there to write."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
