"""When a request stops, and the text it may show so far: the engine's output stage, run on
each step's new tokens after the scheduler has taken them in (``end_stopped``).

Order of checks after each sampled token: a stop token id or EOS ("stop"), then a stop string
in the text ("stop"; the string and what follows are cut), then ``max_tokens`` or the model's
length ("length"). A constrained request's grammar ends with EOS, so EOS ends it even under
``ignore_eos``: nothing could follow.
"""

from __future__ import annotations

from collections.abc import Iterable

from cluster.scheduler.request import EngineRequest
from cluster.scheduler.scheduler import Scheduler


def end_stopped(
    scheduler: Scheduler, requests: Iterable[EngineRequest]
) -> tuple[list[EngineRequest], list[tuple[EngineRequest, Exception]]]:
    """Detokenize the tokens each of ``requests`` just got (one, or several after accepted
    drafts) and finish those they stop; tokens after the one that stops a request are dropped.
    Returns the requests processed, and those whose output could not be (with why): each fails
    alone."""
    eos_token_ids, max_model_len = scheduler.config.eos_token_ids, scheduler.config.max_model_len
    done, failed = [], []
    for request in requests:
        try:
            reason = _stop_in_step(request, eos_token_ids, max_model_len)
        except Exception as exc:
            failed.append((request, exc))
            continue
        if reason is not None:
            scheduler.finish(request, reason)
        done.append(request)
    return done, failed


def _stop_in_step(
    request: EngineRequest, eos_token_ids: tuple[int, ...], max_model_len: int
) -> str | None:
    """Check the step's new tokens one by one; at the first that stops the request, drop
    the rest from its tokens and its pending output."""
    tokens = request.kv.token_ids
    first = len(tokens) - max(request.num_step_tokens, 1)
    for end in range(first + 1, len(tokens) + 1):
        token = tokens[end - 1]
        request.detokenizer.add([token])
        reason = check_stop(request, token, eos_token_ids, max_model_len, num_tokens=end)
        if reason is not None:
            dropped = len(tokens) - end
            if dropped:
                del tokens[end:]
                del request.pending_token_ids[-dropped:]
            return reason
    return None


def check_stop(
    request: EngineRequest,
    token: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    num_tokens: int,
) -> str | None:
    """The finish reason after ``token``, the request's ``num_tokens``-th, was appended (its
    text already detokenized)."""
    num_outputs = num_tokens - request.num_prompt_tokens
    params = request.sampling
    ends_at_eos = not params.ignore_eos or params.is_constrained
    if token in params.stop_token_ids or (ends_at_eos and token in eos_token_ids):
        return "stop"
    # Below min_tokens the sampler holds stop tokens back, and stop strings are not looked for.
    is_past_min = num_outputs >= params.min_tokens
    if params.stop and is_past_min and _cut_at_stop_string(request):
        return "stop"
    if num_outputs >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None


def _cut_at_stop_string(request: EngineRequest) -> bool:
    text = request.detokenizer.text
    # A stop string can only newly appear near the end; search from where it could start.
    longest = max(len(s) for s in request.sampling.stop)
    start = max(0, request.emitted_text_len - longest)
    hits = [i for i in (text.find(s, start) for s in request.sampling.stop) if i >= 0]
    if not hits:
        return False
    request.detokenizer.text = text[: min(hits)]
    return True


def releasable_text(request: EngineRequest) -> str:
    """New text safe to send: with stop strings, hold back a tail that could still become one."""
    text = request.detokenizer.text
    end = len(text)
    if request.sampling.stop and not request.is_finished:
        end = max(request.emitted_text_len, end - (max(len(s) for s in request.sampling.stop) - 1))
    released = text[request.emitted_text_len : end]
    request.emitted_text_len = end
    return released
