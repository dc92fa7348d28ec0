"""What every integer and string a request may set can hold: one table, applied where a request
enters (``cluster.admission``, with the served model's limits, for every front end) and by
``SamplingParams`` itself (with the wire's), so no value reaches the scheduler that the step
plan cannot encode or the model cannot use.

The step plan travels as MessagePack, whose integers are 64-bit and whose strings are UTF-8: a
JSON integer past 64 bits, or a string holding a lone surrogate (JSON's ``"\\ud800"``), would
fail the whole step for every request in it. Each refusal names the field and what it allows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_NESTING = 32  # lists and objects inside a chat message (tool calls and their arguments)
# ... and inside a JSON schema, where each nested object takes two (it and its "properties").
MAX_SCHEMA_NESTING = 64


class RequestFieldError(ValueError):
    """A request field holds what it may not; ``field`` names it (``stop_token_ids[2]``)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelLimits:
    """What the served model can take; left out, a bound is the wire's (64 bits)."""

    vocab_size: int = INT64_MAX
    max_model_len: int = INT64_MAX


@dataclass(frozen=True)
class IntegerLimit:
    low: int
    high: Callable[[ModelLimits], int]
    meaning: Callable[[ModelLimits], str]  # what the upper bound is, for the message
    # Values allowed below ``low`` with a meaning of their own (top_k's -1 and 0: off).
    special: tuple[int, ...] = ()
    half_open: bool = False  # say [low, high + 1): token ids are in [0, vocab_size)

    def problem(self, field: str, value: int, model: ModelLimits) -> str | None:
        high = self.high(model)
        if isinstance(value, int) and (self.low <= value <= high or value in self.special):
            return None
        interval = f"[{self.low}, {high + 1})" if self.half_open else f"[{self.low}, {high}]"
        allowed = f"in {interval} ({self.meaning(model)})"
        if self.special:
            allowed = f"{' or '.join(map(str, self.special))} (off), or {allowed}"
        return f"{field} must be {allowed}; got {value!r}"


def _wire(model: ModelLimits) -> int:
    return INT64_MAX


def _context(model: ModelLimits) -> str:
    if model.max_model_len == INT64_MAX:
        return "64-bit"
    return "this model's maximum context length"


def _vocabulary(model: ModelLimits) -> str:
    if model.vocab_size == INT64_MAX:
        return "64-bit"
    return f"this model's vocabulary of {model.vocab_size} tokens"


TOKEN_ID = IntegerLimit(0, lambda m: m.vocab_size - 1, _vocabulary, half_open=True)

# Every integer sampling field, and what it may hold. Lists (stop_token_ids) are checked item
# by item; prompt token ids take TOKEN_ID as well.
INTEGER_LIMITS: dict[str, IntegerLimit] = {
    "max_tokens": IntegerLimit(1, lambda m: m.max_model_len, _context),
    "min_tokens": IntegerLimit(0, lambda m: m.max_model_len, _context),
    "top_k": IntegerLimit(1, lambda m: m.vocab_size, _vocabulary, special=(-1, 0)),
    "seed": IntegerLimit(INT64_MIN, _wire, lambda m: "64-bit"),
    "logprobs": IntegerLimit(0, lambda m: MAX_LOGPROBS, lambda m: "as OpenAI allows"),
    "stop_token_ids": TOKEN_ID,
}
# Sampling fields that hold text (each item, for lists).
TEXT_FIELDS = ("stop",)


def check_sampling_fields(fields: dict, model: ModelLimits) -> None:
    """Raise RequestFieldError for the first integer or text field of ``fields`` (sampling
    field name -> value; None means unset) that ``model`` cannot take."""
    for name, limit in INTEGER_LIMITS.items():
        for field, value in _items(name, fields.get(name)):
            problem = limit.problem(field, value, model)
            if problem is not None:
                raise RequestFieldError(problem, field)
    for name in TEXT_FIELDS:
        for field, value in _items(name, fields.get(name)):
            check_text(value, field)


def check_token_ids(token_ids: Iterable[int], model: ModelLimits, field: str) -> None:
    high = model.vocab_size
    for index, token in enumerate(token_ids):
        if not (isinstance(token, int) and 0 <= token < high):
            problem = TOKEN_ID.problem(f"{field}[{index}]", token, model)
            raise RequestFieldError(problem, field)


def check_text(value: object, field: str) -> None:
    """A string must be text UTF-8 can encode: no lone surrogates (U+D800..U+DFFF)."""
    if not isinstance(value, str):
        raise RequestFieldError(f"{field} must be a string; got {type(value).__name__}", field)
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestFieldError(
            f"{field} is not valid Unicode text: it holds the lone surrogate "
            f"U+{ord(value[exc.start]):04X} at character {exc.start}; send UTF-8 text",
            field,
        ) from None


def check_nested_text(value: object, field: str, depth: int = 0, limit: int = MAX_NESTING) -> None:
    """Every string in ``value`` (keys too), through lists and dicts, as ``check_text``; and
    no deeper than ``limit``, so what walks it later cannot run out of stack."""
    if depth > limit:
        raise RequestFieldError(f"{field} nests deeper than {limit} levels", field)
    if isinstance(value, str):
        check_text(value, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, f"a key of {field}")
            check_nested_text(item, f"{field}.{key}", depth + 1, limit)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_nested_text(item, f"{field}[{index}]", depth + 1, limit)


def _items(name: str, value) -> list[tuple[str, object]]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", item) for i, item in enumerate(value)]
    return [(name, value)]
