"""What a pipeline stage's step channel carries (``--step-transport socket`` with stages):
the plan, and for the stages before the last the tokens earlier steps sampled. The hidden
states go from stage to stage point to point (``workers.parallel.send_to_next_stage``); the
last stage answers with the step's result, the others with nothing."""

from __future__ import annotations

import msgspec


class StageStep(msgspec.Struct, frozen=True, kw_only=True):
    plan: bytes  # an encoded StepPlan
    # (plan, result) of steps the last stage answered since the previous frame, encoded.
    owed: list[tuple[bytes, bytes]] = []
