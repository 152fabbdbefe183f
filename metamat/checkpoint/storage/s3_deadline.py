"""Time bounds of S3 calls: every store call runs as a task on one background event loop and
is waited for until a :class:`Deadline`, then cancelled, which drops its request (a blocking
call in a thread could only be abandoned, still reading or listing).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["DEFAULT_DEADLINE", "DEADLINE_ENV", "Deadline", "DeadlineExceeded",
           "deadline_seconds", "run"]

#: Seconds a remote operation (an open, a load's reads) may take, unless
#: ``storage_options["deadline"]`` or the environment variable says otherwise. Below the ranks'
#: agreement timeout (``METAMAT_TIMEOUT``, 600 s): a rank whose store stalls raises its
#: ReadError in time for its peers to raise one naming it, rather than time out themselves.
DEFAULT_DEADLINE = 300.0
DEADLINE_ENV = "METAMAT_S3_DEADLINE"


class DeadlineExceeded(TimeoutError):
    """A store call did not finish before the operation's deadline (it was cancelled).
    An ``OSError``: callers turn it into a :class:`~.errors.ReadError` naming the object."""


class Deadline:
    """The end of one remote operation, ``seconds`` from now (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def exceeded(self, what: str) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"{what}: no answer within the deadline of {self.seconds:g} s (raise it with "
            f"storage_options={{'deadline': seconds}} or {DEADLINE_ENV})")


def deadline_seconds(raw: Any) -> float:
    """``raw`` (a ``deadline`` storage option) as seconds, else the environment's, else the
    default."""
    where = "storage_options['deadline']"
    if raw is None:
        raw, where = os.environ.get(DEADLINE_ENV), DEADLINE_ENV
    if raw is None:
        return DEFAULT_DEADLINE
    try:
        v = float(raw)
    except (TypeError, ValueError):
        v = float("nan")
    if not v > 0:  # also NaN
        raise ValueError(f"{where} must be a positive number of seconds, got {raw!r}")
    return v


# -- one background event loop runs every store call (obstore's async API)
_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="metamat-s3-loop",
                             daemon=True).start()
            _LOOP = loop
        return _LOOP


def _after_fork_in_child() -> None:
    """A forked child has the loop object but not its thread: it makes its own."""
    global _LOOP, _LOOP_LOCK
    _LOOP, _LOOP_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def run(make: Callable[[], Any], dl: Deadline, what: str):
    """``await make()`` on the store loop, waited for until ``dl``; cancelled after it.

    Raises:
        DeadlineExceeded: ``dl`` passed (``what`` names the object and request).
        Whatever the call raises.
    """
    left = dl.left()
    if left <= 0:
        raise dl.exceeded(what)

    async def call():  # obstore's awaitables are made on the loop that awaits them
        return await make()
    fut = asyncio.run_coroutine_threadsafe(call(), _loop())
    try:
        return fut.result(timeout=min(left, threading.TIMEOUT_MAX))
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise dl.exceeded(what) from None
    except BaseException:  # KeyboardInterrupt while waiting: stop the request too
        fut.cancel()
        raise
