"""A stage's hidden states over its step channel: bytes, shape and dtype, back as they left,
bfloat16 (which numpy lacks) and an empty step's included."""

from __future__ import annotations

import pytest
import torch

from kvcore import decode, encode
from workers.stage_wire import HiddenStates, StageStep, pack_hidden, unpack_hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hidden_states_come_back_bit_for_bit(dtype):
    hidden = torch.randn(5, 24).to(dtype)
    step = StageStep(plan=b"plan", owed=[(b"p", b"r")], hidden=pack_hidden(hidden))
    received = decode(encode(step), StageStep)
    back = unpack_hidden(received.hidden, torch.device("cpu"))
    assert back.dtype == dtype and torch.equal(back, hidden)
    assert received.owed == [(b"p", b"r")] and received.plan == b"plan"


def test_an_empty_step_has_empty_hidden_states():
    back = unpack_hidden(pack_hidden(torch.empty(0, 24)), torch.device("cpu"))
    assert back.shape == (0, 24)


def test_an_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown dtype 'nonsense'"):
        unpack_hidden(HiddenStates(data=b"", shape=[0], dtype="nonsense"), torch.device("cpu"))
