"""What a constrained request's output must match: one JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar (xgrammar's dialect). A plain
msgspec struct inside ``SamplingParams``: front ends fill it (``response_format``, vLLM's
``structured_outputs``, forced tool calls), the controller compiles it
(``cluster.structured``), and rank 0's sampler masks the logits with it
(``workers.grammar``).
"""

from __future__ import annotations

import msgspec

from workers.request_limits import RequestFieldError, check_text

MAX_SPEC_CHARS = 65536  # a schema, regex or grammar's text; every choice together
MAX_CHOICES = 1024
FIELD = "structured_outputs"


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @property
    def kind(self) -> str:
        """Which of the forms this one is (exactly one is set once checked)."""
        return next(name for name in KINDS if _is_set(getattr(self, name)))

    @property
    def key(self) -> tuple:
        """What compiling it depends on, for caches."""
        return (self.kind, getattr(self, self.kind))

    def check(self) -> None:
        """Raise RequestFieldError unless exactly one form is set, within the limits."""
        given = [name for name in KINDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            raise RequestFieldError(
                f"{FIELD} must set exactly one of {list(KINDS)}; got {given or 'none'}",
                FIELD,
            )
        kind = given[0]
        texts = list(self.choice) if kind == "choice" else [getattr(self, kind)]
        if kind == "json_object":
            return
        if kind == "choice" and not texts:
            raise RequestFieldError("choice must hold at least one string", f"{FIELD}.choice")
        if kind == "choice" and len(texts) > MAX_CHOICES:
            raise RequestFieldError(f"choice holds {len(texts)} strings; at most "
                                    f"{MAX_CHOICES} are allowed", f"{FIELD}.choice")  # fmt: skip
        for index, text in enumerate(texts):
            field = f"{FIELD}.{kind}" + (f"[{index}]" if kind == "choice" else "")
            check_text(text, field)
            if not text:
                raise RequestFieldError(f"{field} must not be empty", field)
        if sum(len(text) for text in texts) > MAX_SPEC_CHARS:
            raise RequestFieldError(
                f"{FIELD}.{kind} holds more than {MAX_SPEC_CHARS} characters", f"{FIELD}.{kind}"
            )


KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


def _is_set(value) -> bool:
    return value is not None and value is not False
