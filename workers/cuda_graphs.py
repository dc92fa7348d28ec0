"""Decode steps replayed from CUDA graphs.

A decode step of a small batch launches every layer's kernels (a few hundred for an 8B model)
for a few microseconds of work each, so on a GPU the host's launching, not the device, sets
its pace. A CUDA graph records those launches once and replays them in one call. The runner
captures the model's forward for a set of batch sizes (``graph_batch_sizes``) after the KV
cache is allocated; a decode step of ``n`` requests then pads to the smallest captured size
``>= n``, writes its inputs (token ids, positions, each group's metadata) into the static
buffers the graph was captured over, and replays it.

What a graph replays is fixed at capture: the tensors it read and the Python values its
launches took. So nothing in the captured region may depend on a step's values except through
those buffers, and nothing may read the device back (``.item()``, ``.tolist()``, a sync).
Each group's kind provides its static inputs (``GroupStepBuilder.graph_inputs``); a kind, or a
backend, that cannot keeps the engine eager, as does ``--enforce-eager``.

``mode="emulate"`` keeps the same discipline on a CPU for tests: "capture" freezes the region
(its inputs are the same static buffers and the same captured-time step objects) and "replay"
runs it again, so a kernel that read a step's value from anywhere but the buffers would give
wrong tokens there as it would on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from workers.forward_context import ForwardContext, set_forward_context
from workers.group_step import GraphStepInputs, GroupStepBuilder, StepBatch

logger = logging.getLogger(__name__)

# The largest batch captured: past it a decode step's launches are a small share of its time.
MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to the most requests a step can hold."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {size for size in (1, 2, 4) if size <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def padded_batch_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows; None past the largest."""
    return next((size for size in sizes if size >= num_reqs), None)


class DecodeGraphs:
    def __init__(
        self,
        model,
        group_inputs: list[GraphStepInputs],
        layer_groups: dict[str, int],
        sizes: Sequence[int],
        device: torch.device,
        mode: str = "cuda",
    ):
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"decode graph mode {mode!r}: expected cuda or emulate")
        self.model = model
        self.group_inputs = group_inputs
        self.layer_groups = layer_groups
        self.sizes = tuple(sorted(sizes))
        self.mode = mode
        max_batch = self.sizes[-1]
        self.token_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host_inputs = torch.zeros((2, max_batch), dtype=torch.long, pin_memory=pin)
        # Per size: the call that replays it, returning the graph's static output.
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_replays = dict.fromkeys(self.sizes, 0)  # per size, since startup
        self._pool = None

    @classmethod
    def for_runner(
        cls,
        model,
        builders: list[GroupStepBuilder],
        layer_groups: dict[str, int],
        table_widths: list[int],
        sizes: Sequence[int],
        device: torch.device,
        mode: str = "cuda",
    ) -> DecodeGraphs | None:
        """Graphs over every group's static inputs; None (decode runs eagerly) when a group's
        kind or backend cannot be captured."""
        max_batch = max(sizes)
        inputs = []
        for index, (builder, width) in enumerate(zip(builders, table_widths, strict=True)):
            group_inputs = builder.graph_inputs(max_batch, width)
            if group_inputs is None:
                logger.info(
                    "decode runs eagerly: KV-cache group %d (%s, backend %s) has no CUDA-graph "
                    "step",
                    index,
                    type(builder).__name__,
                    builder.group.backend.name,
                )
                return None
            inputs.append(group_inputs)
        return cls(model, inputs, layer_groups, sizes, device, mode)

    def can_run(self, batch: StepBatch) -> bool:
        """A decode step (one new token per request, no drafts) of a captured size or less."""
        num_reqs = len(batch.request_ids)
        return (
            0 < num_reqs <= self.sizes[-1]
            and len(batch.token_ids) == num_reqs
            and not any(batch.num_drafts)
        )

    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        started = time.perf_counter()
        reserved = self._reserved_bytes()
        for size in reversed(self.sizes):
            self._replays[size] = self._capture(size)
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s, %.0f MiB of graph memory",
            len(self.sizes),
            ",".join(map(str, self.sizes)),
            time.perf_counter() - started,
            (self._reserved_bytes() - reserved) / 2**20,
        )

    def _reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved() if self.mode == "cuda" else 0

    def load(self, batch: StepBatch, block_rows: list[torch.Tensor]) -> int:
        """Write a decode step's inputs into the buffers (``block_rows``: each group's host
        table of its requests); the captured size that runs it."""
        num_reqs = len(batch.request_ids)
        size = padded_batch_size(num_reqs, self.sizes)
        host = self._host_inputs.numpy()
        host[0, :num_reqs] = batch.token_ids
        host[1, :num_reqs] = batch.positions
        host[:, num_reqs:size] = 0  # padding rows: token 0 at position 0
        self.token_ids[:size].copy_(self._host_inputs[0, :size], non_blocking=True)
        self.positions[:size].copy_(self._host_inputs[1, :size], non_blocking=True)
        for inputs, rows in zip(self.group_inputs, block_rows, strict=True):
            inputs.load(batch, rows, size)
        return size

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """Hidden states ``[num_reqs, hidden]`` of the step last loaded (valid until the next
        replay: they are the graph's output buffer)."""
        self.num_replays[size] += 1
        return self._replays[size]()[:num_reqs]

    def _capture(self, size: int) -> Callable[[], torch.Tensor]:
        steps = [inputs.step(size) for inputs in self.group_inputs]
        steps_by_layer = {name: steps[i] for name, i in self.layer_groups.items()}
        context = ForwardContext(steps_by_layer, is_graph_region=True)
        token_ids, positions = self.token_ids[:size], self.positions[:size]

        def forward() -> torch.Tensor:
            with torch.inference_mode(), set_forward_context(context):
                return self.model(token_ids, positions)

        if self.mode == "emulate":
            return forward
        forward()  # compiles the kernels and sets up libraries' workspaces outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
