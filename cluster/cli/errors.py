"""What a person reads when a command fails: one line saying what went wrong (and the
traceback only at ``--log-level DEBUG``), even when the error happened in a Ray actor and
reached here wrapped in Ray's own exception types."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("kvray")


def root_error(exc: BaseException) -> BaseException:
    """The error an actor raised, unwrapped from Ray's ``RayTaskError`` / ``ActorDiedError``."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            exc = cause
            continue
        if type(exc).__module__.startswith("ray.") and exc.__cause__ is not None:
            exc = exc.__cause__
            continue
        break
    return exc


def one_line(exc: BaseException) -> str:
    """The error's own message: for a wrapped error Ray printed with its traceback, the last
    ``SomeError: message`` line of that text."""
    exc = root_error(exc)
    text = str(exc).strip()
    if type(exc).__module__.startswith("ray."):
        lines = [line.strip() for line in text.splitlines() if "Error: " in line]
        if lines:
            return lines[-1].split("Error: ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


def report(command: str, exc: BaseException) -> int:
    logger.debug("kvray %s failed", command, exc_info=exc)
    print(f"kvray {command}: error: {one_line(exc)}", file=sys.stderr)
    if logger.getEffectiveLevel() > logging.DEBUG:
        print(f"kvray {command}: (--log-level DEBUG shows the traceback)", file=sys.stderr)
    return 2
