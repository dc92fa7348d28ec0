"""The one table of request field limits (``workers.request_limits``), applied by admission for
every front end: exact refusals that name the field and its range, and a property test that
the step-plan entry of every request admission accepts encodes, and decodes on a worker."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cluster.admission import Admission
from cluster.scheduler.scheduler import new_request_message
from cluster.validation import InvalidRequestError
from kvcore import decode, encode
from workers.protocol import StepPlan
from workers.tokenizer import ByteTokenizer

VOCAB, MAX_MODEL_LEN = 258, 64


def admission() -> Admission:
    return Admission(ByteTokenizer(), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)


def admit(prompt, fields: dict, **kwargs):
    async def run():
        checked = admission()
        sampling = checked.sampling_params(fields)
        return await checked.request(
            prompt, sampling, kwargs.get("request_id"), cache_salt=kwargs.get("cache_salt"),
            hash_block_size=16,
        )  # fmt: skip

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("prompt", "fields", "param", "message"),
    [
        ("hi", {"seed": 2**70}, "seed", r"seed must be in \[-(2\*\*63|9223372036854775808)"),
        ("hi", {"seed": -(2**63) - 1}, "seed", "64-bit"),
        ("hi", {"top_k": 2**70}, "top_k", r"-1 or 0 \(off\), or in \[1, 258\] \(this model's"),
        ("hi", {"top_k": VOCAB + 1}, "top_k", r"in \[1, 258\]"),
        ("hi", {"top_k": -2}, "top_k", "top_k must be -1 or 0"),
        ("hi", {"stop_token_ids": [1, 2**70]}, "stop_token_ids[1]", r"in \[0, 258\)"),
        ("hi", {"stop_token_ids": [VOCAB]}, "stop_token_ids[0]", r"got 258"),
        ("hi", {"min_tokens": 2**70}, "min_tokens", r"in \[0, 64\] \(this model's maximum context"),
        ("hi", {"max_tokens": 2**64}, "max_tokens", r"in \[1, 64\]"),
        ("hi", {"max_tokens": 0}, "max_tokens", r"in \[1, 64\]"),
        ("hi", {"logprobs": 21}, "logprobs", r"in \[0, 20\]"),
        ("hi", {"stop": ["ok", "\ud800"]}, "stop[1]", "lone surrogate U\\+D800 at character 0"),
        ("a\udfffb", {}, "prompt", "lone surrogate U\\+DFFF at character 1"),
        ([5, 2**70], {}, "prompt", r"prompt\[1\] must be in \[0, 258\)"),
        ("hi", {"min_tokens": 63}, "min_tokens", "leave room for 62 output tokens"),
        ("hi", {"temperature": math.nan}, "temperature", "temperature must be 0"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_and_its_range(prompt, fields, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        admit(prompt, fields)
    assert info.value.param == param


@pytest.mark.parametrize(("field", "value"), [("cache_salt", "t\ud800"), ("request_id", "\udc00")])
def test_text_outside_sampling_is_checked_too(field, value):
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        admit("hi", {}, **{field: value})
    assert info.value.param == field


def test_values_at_the_limits_are_taken():
    request = admit(
        "hi",
        {"seed": 2**63 - 1, "top_k": VOCAB, "stop_token_ids": [0, VOCAB - 1], "min_tokens": 5},
    )
    assert request.sampling.max_tokens == 16  # the default, above min_tokens
    assert admit("hi", {"min_tokens": 40}).sampling.max_tokens == 40  # min_tokens, when more
    assert admit("hi", {"seed": -(2**63), "top_k": -1}).sampling.seed == -(2**63)


# -- every accepted request encodes into a step plan ----------------------------------------

huge_ints = st.one_of(st.integers(-(2**80), 2**80), st.sampled_from([2**63, 2**64, -(2**63) - 1]))
small_ints = st.integers(-3, 300)
any_text = st.text(max_size=6)  # surrogates (category Cs) included
FIELDS = {
    "max_tokens": st.one_of(small_ints, huge_ints),
    "min_tokens": st.one_of(small_ints, huge_ints),
    "top_k": st.one_of(small_ints, huge_ints),
    "seed": st.one_of(small_ints, huge_ints),
    "logprobs": st.one_of(st.integers(-2, 25), huge_ints),
    "stop_token_ids": st.lists(st.one_of(small_ints, huge_ints), max_size=3).map(tuple),
    "stop": st.lists(any_text, max_size=3).map(tuple),
    "temperature": st.floats(allow_nan=True, allow_infinity=True),
    "top_p": st.floats(allow_nan=True, allow_infinity=True),
    "repetition_penalty": st.floats(allow_nan=True, allow_infinity=True),
}


@st.composite
def requests(draw):
    fields = {name: draw(values) for name, values in FIELDS.items() if draw(st.booleans())}
    prompt = draw(st.one_of(any_text, st.lists(st.one_of(small_ints, huge_ints), max_size=4)))
    salt = draw(st.none() | any_text)
    return prompt, fields, salt


@example(("hi", {"stop": ("\ud800",)}, None))
@example(("hi", {"seed": 2**70, "top_k": 2**70, "stop_token_ids": (2**70,)}, None))
@settings(max_examples=400, deadline=None)
@given(requests())
def test_every_admitted_request_encodes_into_a_step_plan(case):
    prompt, fields, salt = case
    try:
        request = admit(prompt, fields, cache_salt=salt)
    except InvalidRequestError:
        return  # refused with a message: nothing reached the scheduler
    message = new_request_message(request, [[1]], request.num_prompt_tokens)
    plan = decode(encode(StepPlan(new_requests=[message])), StepPlan)  # as a worker reads it
    assert plan.new_requests[0].sampling == request.sampling
