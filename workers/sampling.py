"""Sampling parameters, checked once where a request enters, and the sampler rank 0 runs.

Greedy when ``temperature == 0``; otherwise temperature, then top-k, then top-p, then a draw.
All rows of a step are sampled together on the logits' device; no row can make the step fail,
whatever its logits hold (a draw is an argmax, never ``torch.multinomial``, which raises on
NaN). A request with a ``seed`` draws from its own generator, made on the same device and kept
until the request ends for good: a preempted request continues its sequence, so it gives the
tokens it would have given had it never been preempted.
"""

from __future__ import annotations

import math

import msgspec
import torch

DEFAULT_MAX_TOKENS = 16  # when a request does not say (clipped to what fits the model)
# Positive temperatures below this are raised to it, as vLLM does: logits divided by less can
# overflow fp32 (a subnormal temperature turns every logit into inf, and softmax into NaN).
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024  # all stop strings together
MAX_STOP_TOKEN_IDS = 256
_SEED_MASK = (1 << 64) - 1  # torch seeds are unsigned 64-bit; any int64 maps onto one


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, clipped to the model's room
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps the whole vocabulary
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problem = _first_problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _first_problem(p: SamplingParams) -> str | None:
    """What is wrong with ``p``, said with what is allowed; None when nothing is."""
    if p.max_tokens is not None and p.max_tokens < 1:
        return f"max_tokens must be at least 1, got {p.max_tokens}"
    if not math.isfinite(p.temperature) or p.temperature < 0:
        return (
            f"temperature must be 0 (greedy) or a finite positive number, got {p.temperature} "
            f"(values below {MIN_TEMPERATURE} are raised to {MIN_TEMPERATURE})"
        )
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k < -1:
        return f"top_k must be -1, 0 (disabled) or positive, got {p.top_k}"
    if len(p.stop) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(p.stop)}"
    if any(not s for s in p.stop):
        return "stop strings must not be empty"
    if sum(len(s) for s in p.stop) > MAX_STOP_CHARS:
        return f"stop strings may hold at most {MAX_STOP_CHARS} characters together"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed"
    return None


class Sampler:
    """Samples one token per row on ``device``; holds the seeded requests' generators."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator(device=self.device)
        self._shared.seed()

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """Start a seeded request's generator; a resumed (preempted) request keeps its own."""
        if params.seed is not None and request_id not in self._generators:
            generator = torch.Generator(device=self.device)
            self._generators[request_id] = generator.manual_seed(params.seed & _SEED_MASK)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        """One token id per row of ``logits`` ``[R, vocab]``, as an int64 tensor on its
        device."""
        greedy = logits.argmax(dim=-1)  # [R]
        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            return greedy
        device = logits.device
        # Greedy rows divide by 1: their draw is discarded, but must stay finite.
        temperatures = [1.0 if p.is_greedy else max(p.temperature, MIN_TEMPERATURE) for p in params]
        temperature = torch.tensor(temperatures, dtype=torch.float32, device=device)
        logits = logits.float() / temperature[:, None]
        vocab_size = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if min(top_k) < vocab_size or min(top_p) < 1.0:
            sampled = self._draw_filtered(logits, top_k, top_p, request_ids, params)
        else:
            sampled = self._draw(torch.softmax(logits, dim=-1), request_ids, params)
        return torch.where(torch.tensor(is_greedy, device=device), greedy, sampled)

    def _draw_filtered(self, logits, top_k, top_p, request_ids, params) -> torch.Tensor:
        """Top-k, then top-p, on logits sorted once; the draw happens in sorted order."""
        device = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(logits.shape[-1], device=device)[None, :]  # [1, V]
        k = torch.tensor(top_k, dtype=torch.int64, device=device)[:, None]  # [R, 1]
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
        p = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= p, 0.0)
        picked = self._draw(probs, request_ids, params)  # [R] positions in sorted order
        return order.gather(1, picked[:, None]).squeeze(1)

    def _draw(self, probs: torch.Tensor, request_ids, params) -> torch.Tensor:
        """A draw per row by the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)``
        picks index i with probability ``probs[i] / sum(probs)``, unnormalised rows included."""
        noise = torch.empty_like(probs).exponential_(generator=self._shared)
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.seed is not None and not p.is_greedy:
                noise[row].exponential_(generator=self._generators[request_id])
        # A draw of exactly 0 would make a filtered-out token 0 / 0 = NaN, which argmax picks.
        return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
