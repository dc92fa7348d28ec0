"""Sampling parameters and the sampler that runs on rank 0.

Greedy when ``temperature == 0``; otherwise temperature, then top-k, then top-p, then a draw.
A request with a ``seed`` draws from its own generator, seeded once when it arrives, so the same
seeded request gives the same tokens whatever else shares its batches.
"""

from __future__ import annotations

import msgspec
import torch


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps the whole vocabulary
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator()
        self._shared.seed()

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        if params.seed is not None:
            self._generators[request_id] = torch.Generator().manual_seed(params.seed)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        """One token per row of ``logits`` ``[R, vocab]`` (float32)."""
        tokens = logits.argmax(dim=-1)  # greedy for every row; the others are replaced below
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.is_greedy:
                continue
            probs = _filtered_probs(logits[row] / p.temperature, p.top_k, p.top_p)
            generator = self._generators.get(request_id, self._shared)
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
        return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax over the tokens that survive top-k, then top-p (the top token always does)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs
