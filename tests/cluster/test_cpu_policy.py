"""The engine loop's process runs under SCHED_BATCH (``cluster.cpu_policy``): every thread it
has when the policy is applied, and those started after, on Linux; ``normal`` puts them back.
Each case runs in a child process, so pytest's own threads keep their policy."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

import pytest

from cluster.cpu_policy import apply_engine_cpu_policy

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="scheduling policies are Linux's"
)


def thread_policies() -> set[int]:
    return {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}


def policies_before_and_after(policy: str, queue) -> None:
    """In a child: a thread started before the policy is applied and one started after."""
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    changed = apply_engine_cpu_policy(policy)
    later = threading.Thread(target=stop.wait, daemon=True)
    later.start()
    queue.put((changed, thread_policies()))
    stop.set()


def in_child(policy: str):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=policies_before_and_after, args=(policy, queue))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    return result


def test_batch_reaches_every_thread_and_those_started_after():
    changed, policies = in_child("batch")
    assert changed >= 2  # the main thread and the one started before
    assert policies == {os.SCHED_BATCH}


def test_normal_leaves_every_thread_under_the_default_policy():
    _, policies = in_child("normal")
    assert policies == {os.SCHED_OTHER}


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'fifo'"):
        apply_engine_cpu_policy("fifo")
