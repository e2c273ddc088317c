"""Waiting on a condition in a test, never on a sleep: poll what the test needs (a file, a
log line, a counter, a socket that answers) until it holds, with a deadline only a real
hang reaches (under a CPU hog on both cores the condition still comes, just later), and
fail naming what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

# Long enough that only a hang reaches it on a loaded 2-core machine, short enough that a
# hang fails the test rather than the CI job's timeout.
DEFAULT_TIMEOUT_S = 30.0


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT_S,
    what: str = "the condition",
    interval: float = 0.02,
) -> T:
    """Poll `predicate` until it returns something truthy and return that; after
    `timeout` seconds raise TimeoutError naming `what` (and the last value seen)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not after {timeout:g} s (last: {value!r})")
        time.sleep(interval)


async def until(
    predicate: Callable[[], T | None],
    limit: float = DEFAULT_TIMEOUT_S,
    what: str = "the condition",
    interval: float = 0.02,
) -> T:
    """`wait_until` inside an event loop: polls without blocking the loop."""
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not after {limit:g} s (last: {value!r})")
        await anyio.sleep(interval)
