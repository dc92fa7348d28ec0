"""``--speculative-config``: a JSON object with vLLM's keys. Only the n-gram method (prompt
lookup) is served; draft-model methods (EAGLE, MTP, ...) are refused by name, and the struct
has room for them: a method names its proposer, the other keys are the method's."""

from __future__ import annotations

import msgspec

SUPPORTED_METHODS = ("ngram",)
# Methods vLLM serves that need a draft model or extra heads: refused with what is supported.
DRAFT_MODEL_METHODS = (
    "draft_model",
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "deepseek_mtp",
    "suffix",
)
MAX_SPECULATIVE_TOKENS = 16  # a step verifies at most this many drafts per request
DEFAULT_LOOKUP = 5  # n-gram length when neither bound is given, as vLLM's default


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    method: str
    num_speculative_tokens: int
    # The longest and shortest suffix of a request's tokens looked up earlier in them.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(shortest, longest) n-gram: a bound not given takes the other's value."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return DEFAULT_LOOKUP, DEFAULT_LOOKUP
        return (high if low is None else low), (low if high is None else high)


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The checked config of ``--speculative-config``'s JSON; ValueError says what is wrong
    and what is allowed."""
    try:
        config = msgspec.json.decode(text, type=SpeculativeConfig)
    except msgspec.ValidationError as exc:
        fields = ", ".join(SpeculativeConfig.__struct_fields__)
        raise ValueError(f"--speculative-config: {exc} (keys: {fields})") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
    if config.method in DRAFT_MODEL_METHODS:
        raise ValueError(
            f"--speculative-config: method {config.method!r} needs a draft model or extra "
            f"heads, which kvray does not serve yet; supported: {', '.join(SUPPORTED_METHODS)}"
        )
    if config.method not in SUPPORTED_METHODS:
        raise ValueError(
            f"--speculative-config: unknown method {config.method!r}; supported: "
            f"{', '.join(SUPPORTED_METHODS)}"
        )
    if not 1 <= config.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            "--speculative-config: num_speculative_tokens must be in "
            f"[1, {MAX_SPECULATIVE_TOKENS}], got {config.num_speculative_tokens}"
        )
    low, high = config.lookup_range
    if not 1 <= low <= high:
        raise ValueError(
            "--speculative-config: prompt_lookup_min and prompt_lookup_max must satisfy "
            f"1 <= min <= max, got min {low}, max {high}"
        )
    return config
