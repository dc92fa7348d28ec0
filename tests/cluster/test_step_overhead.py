"""Whose clock measures a step's wall time (``AsyncEngine._step_wall``): rank 0's for a step
sent ahead, so an answer the engine loop reads late (busy streaming the last step's tokens) is
not counted as time the workers lost; the loop's own for a step sent to idle workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.engine import AsyncEngine, SentStep
from workers.protocol import StepResult


def wall(sent: SentStep, result: StepResult, now: float, last_answer_at: float) -> float:
    engine = SimpleNamespace(_last_answer_at=last_answer_at)
    return AsyncEngine._step_wall(engine, sent, result, now)


def test_a_step_sent_ahead_is_timed_by_rank_0():
    sent = SentStep(step=None, task=None, sent_at=10.0, ahead=True)
    result = StepResult(forward_seconds=0.006, step_seconds=0.0065, waited_seconds=0.0002)
    # The loop reads the answer 5 ms after the one before it, though rank 0 answered 6.7 ms
    # after its last reply: the workers' figure stands.
    assert wall(sent, result, now=10.020, last_answer_at=10.015) == pytest.approx(0.0067)


def test_a_rank_kept_waiting_for_its_plan_counts_the_wait():
    sent = SentStep(step=None, task=None, sent_at=10.0, ahead=True)
    result = StepResult(forward_seconds=0.006, step_seconds=0.0065, waited_seconds=0.004)
    assert wall(sent, result, now=10.1, last_answer_at=10.0) == pytest.approx(0.0105)


def test_a_step_sent_to_idle_workers_is_timed_from_its_sending():
    sent = SentStep(step=None, task=None, sent_at=10.0, ahead=False)
    result = StepResult(forward_seconds=0.006, step_seconds=0.0065, waited_seconds=3.0)
    # The 3 s the rank waited were the engine having no work: not overhead.
    assert wall(sent, result, now=10.008, last_answer_at=9.0) == pytest.approx(0.008)
    # A step sent before the last answer was read runs from that answer.
    assert wall(sent, result, now=10.008, last_answer_at=10.001) == pytest.approx(0.007)


def test_a_transport_without_rank_timing_falls_back_to_the_loop():
    sent = SentStep(step=None, task=None, sent_at=10.0, ahead=True)
    assert wall(sent, StepResult(forward_seconds=0.006), 10.01, 10.002) == pytest.approx(0.008)
