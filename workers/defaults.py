"""Engine defaults that both the serving configuration (``cluster.config.EngineConfig``) and
the worker's own options (``workers.worker.WorkerOptions``) carry: defined once, here. The
CLI shows EngineConfig's, so a default changes in one place."""

from __future__ import annotations

BLOCK_SIZE = 16  # tokens per KV block
MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step
MAX_NUM_SEQS = 256  # requests running at once
GPU_MEMORY_UTILIZATION = 0.9  # share of each GPU kvray may use
# Hybrids: a Mamba state is kept for the prefix cache every this many tokens. Small enough that
# short shared prefixes (a system prompt) hit; each kept state costs one state page per layer.
MAMBA_STATE_INTERVAL = 128
