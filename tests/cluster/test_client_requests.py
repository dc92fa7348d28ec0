"""What the Python client refuses before anything is sent: values protobuf cannot carry (an
integer past 64 bits, text UTF-8 cannot encode) come back as InvalidRequestError naming the
field, as the server's own refusals do, not as protobuf's ValueError or an encoding error."""

from __future__ import annotations

import grpc
import pytest

from cluster.client import InvalidRequestError, build_request

CONVERSATION = [{"role": "user", "content": "a\ud800b"}]


@pytest.mark.parametrize(
    ("prompt", "sampling", "match"),
    [
        ("hello", {"seed": 2**70}, r"^seed: .*1180591620717411303424"),
        ("hello", {"max_tokens": -(2**80)}, r"^max_tokens: "),
        ("a\ud800b", {}, r"^prompt is not valid Unicode text .* at character 1"),
        (CONVERSATION, {}, r"^prompt is not valid Unicode text"),
        ("hello", {"stop": ["x\udfff"]}, r"^stop is not valid Unicode text"),
    ],
)
def test_values_protobuf_cannot_carry_are_invalid_requests(prompt, sampling, match):
    with pytest.raises(InvalidRequestError, match=match) as refused:
        build_request(prompt, None, sampling)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_what_protobuf_carries_is_built_unchanged():
    request = build_request("héllo ✓", "r1", {"seed": 2**63 - 1, "stop": ["\n"]})
    assert (request.text, request.sampling.seed, list(request.sampling.stop)) == (
        "héllo ✓",
        2**63 - 1,
        ["\n"],
    )
