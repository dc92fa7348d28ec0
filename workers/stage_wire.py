"""What a pipeline stage's step channel carries (``--step-transport socket`` with stages):
the plan, the tokens earlier steps sampled (stages before the last), and the previous stage's
hidden states as raw bytes with their shape and dtype. A stage before the last answers with
its own hidden states from TP rank 0 (the other ranks' are the same and answer nothing); the
last answers with the step's result."""

from __future__ import annotations

import msgspec
import torch


class HiddenStates(msgspec.Struct, frozen=True, kw_only=True):
    data: bytes  # the tensor's bytes, row-major
    shape: list[int]
    dtype: str  # torch's name: "float32", "bfloat16", ...


class StageStep(msgspec.Struct, frozen=True, kw_only=True):
    plan: bytes  # an encoded StepPlan
    # (plan, result) of steps the last stage answered since the previous frame, encoded.
    owed: list[tuple[bytes, bytes]] = []
    hidden: HiddenStates | None = None  # None on the first stage


def pack_hidden(hidden: torch.Tensor) -> HiddenStates:
    """``hidden``'s bytes, read through uint8 so that dtypes numpy lacks (bfloat16) travel."""
    flat = hidden.detach().contiguous().cpu().view(torch.uint8)
    return HiddenStates(
        data=flat.numpy().tobytes(),
        shape=list(hidden.shape),
        dtype=str(hidden.dtype).removeprefix("torch."),
    )


def unpack_hidden(packed: HiddenStates, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, packed.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"hidden states of unknown dtype {packed.dtype!r}")
    if not packed.data:
        return torch.empty(packed.shape, dtype=dtype, device=device)
    raw = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(packed.shape).to(device)
