"""Rotary position embedding (the half-split form used by Llama-family checkpoints, or the
interleaved-pairs form of DeepSeek's ``rope_interleave``), with the ``llama3`` and ``yarn``
frequency scalings for contexts past the pretraining length.

One instance serves every layer of a model: the cos and sin of a step's positions are
computed by the first layer and reused by the others (the runner hands all layers the same
``positions`` tensor), instead of evaluating two transcendental functions per layer.
The scalings follow transformers' ``ROPE_INIT_FUNCTIONS``, formula for formula.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from workers.forward_context import in_graph_region
from workers.model_config import RopeScaling


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        theta: float,
        scaling: RopeScaling | None = None,
        *,
        is_interleaved: bool = False,
    ):
        super().__init__()
        # Interleaved: dims (2i, 2i+1) turn together, written back as evens then odds, as
        # transformers' DeepSeek-V3 does; queries and keys share the order, so their products
        # equal those of the pairs left in place.
        self.is_interleaved = is_interleaved
        inv_freq, self.attention_factor = rope_frequencies(head_size, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._step: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # see _cpu_tables
        self._cast: tuple | None = None  # (the step's fp32 cos, dtype, cos and sin in it)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hk, D]`` rotated by their positions."""
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every head of ``x`` ``[T, H, D]`` rotated by its token's position."""
        cos, sin = self._cos_sin_as(positions, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
        if self.is_interleaved:
            return _rotate_pairs(x, cos, sin)
        return _rotate(x, cos, sin)

    def _cos_sin_as(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tables in ``dtype``, cast once per step for every layer (a bf16 model
        would otherwise cast them twice in each)."""
        cos, sin = self._cos_sin(positions)
        if cos.dtype == dtype:
            return cos, sin
        cast = self._cast
        if cast is None or cast[0] is not cos or cast[1] != dtype:
            cast = self._cast = (cos, dtype, cos.to(dtype), sin.to(dtype))
        return cast[2], cast[3]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[T, D]`` tables of this step, computed once for all layers. The same tensor
        written again in place (its version moves) is a new step."""
        if self._step is not None:
            same, version, cos, sin = self._step
            if same is positions and version == positions._version:
                return cos, sin
        if positions.device.type == "cpu" and not in_graph_region():
            # Rows of a table kept across steps: one gather where the product and its two
            # transcendental functions cost ~0.2 ms a step on two cores. (On a GPU they are
            # cheap, and sizing the table would read the positions back, which a graph's
            # region may not.)
            tables = self._cpu_tables(int(positions.max()) + 1)
            cos, sin = (table.index_select(0, positions) for table in tables)
        else:
            cos, sin = self._compute_cos_sin(positions)
        self._step = (positions, positions._version, cos, sin)
        return cos, sin

    def _compute_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # yarn sharpens attention at long range
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _cpu_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[P, D]`` cos and sin of positions 0..P-1, P grown to a power of two (at least
        1024) when a step goes past it."""
        tables = self._tables
        if tables is None or tables[0].shape[0] < num_positions:
            size = max(1024, 1 << (num_positions - 1).bit_length())
            positions = torch.arange(size, dtype=torch.int64, device="cpu")
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [P, D/2], as above
            # cos and sin in float64 by numpy, rounded to float32 once: within half a unit of
            # the last place, on this thread. (Torch's float32 cos is within one unit, but in
            # tests the rows its second OpenMP thread took in the process's first call were
            # 1.5e-4 off; a table kept for the process's life must not hold them.)
            angles = freqs.double().numpy()
            halves = (torch.from_numpy(f(angles)).float() for f in (np.cos, np.sin))
            cos, sin = (torch.cat((h, h), dim=-1) for h in halves)
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            tables = self._tables = (cos, sin)
        return tables


def rope_frequencies(
    head_size: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, float]:
    """fp32 ``[D/2]`` inverse frequencies, and the factor cos and sin are multiplied by."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    wavelen_scale = theta**exponents  # [D/2] (each wavelength over 2 pi)
    if scaling is None:
        return 1.0 / wavelen_scale, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(1.0 / wavelen_scale, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(wavelen_scale, head_size, theta, scaling)
    raise ValueError(f"Unsupported RoPE type {scaling.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths (past original / low_freq_factor) are divided by ``factor``, short
    ones (below original / high_freq_factor) kept, and the band between blended smoothly."""
    original = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= original / s.high_freq_factor) & (
        wavelen <= original / s.low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    wavelen_scale: torch.Tensor, head_size: int, theta: float, s: RopeScaling
) -> tuple[torch.Tensor, float]:
    """Dimensions that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times kept,
    with a linear ramp between; cos and sin grow by the attention factor."""

    def dimension(num_rotations: float) -> float:  # the dimension turning that many times
        wavelen = s.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return head_size * math.log(wavelen) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # the ramp needs a width
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept_share = 1 - ramp  # [D/2]; 1 - kept_share, not ramp, rounds as transformers does
    interpolated, kept = 1.0 / (s.factor * wavelen_scale), 1.0 / wavelen_scale
    return interpolated * (1 - kept_share) + kept * kept_share, _yarn_attention_factor(s)


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:  # DeepSeek's form
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]  # the tables repeat each pair's angle twice
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
