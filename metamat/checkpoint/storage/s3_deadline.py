"""Time bounds of S3 calls: every store call runs as a task on one background event loop and
is waited for until a :class:`Deadline`, then cancelled, which drops its request (a blocking
call in a thread could only be abandoned, still reading or listing).
"""
from __future__ import annotations

import asyncio
import atexit
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
class _StoreLoop(asyncio.SelectorEventLoop):
    """The store loop, counting the calls of ``call_soon_threadsafe`` in progress: obstore's
    runtime threads hand every answer over through it, holding the GIL, and let the GIL go in
    its wake-up ``send``. A program that exits as soon as it has the answer would finalize
    the interpreter while such a thread waits to take the GIL back, and the thread, stopped
    there by Python inside Rust frames, aborts the process (SIGABRT at exit, seen in about 1
    of 20 CLI runs on a loaded 2-core box). The exit hook waits for those calls to end."""

    def __init__(self) -> None:
        super().__init__()
        self._handing_over = 0
        self._count_lock = threading.Lock()

    def call_soon_threadsafe(self, callback, *args, context=None):
        with self._count_lock:
            self._handing_over += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            with self._count_lock:
                self._handing_over -= 1

    def handing_over(self) -> int:
        with self._count_lock:
            return self._handing_over


_LOOP: Optional[_StoreLoop] = None
_THREAD: Optional[threading.Thread] = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP, _THREAD
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed() or not _THREAD.is_alive():
            loop = _StoreLoop()
            _THREAD = threading.Thread(target=loop.run_forever, name="metamat-s3-loop",
                                       daemon=True)
            _THREAD.start()
            _LOOP = loop
        return _LOOP


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@atexit.register
def _stop_at_exit(wait_s: float = 2.0) -> None:
    """Before the interpreter finalizes: cancel what the store loop still runs, stop it, and
    wait (GIL released) until no runtime thread is inside ``call_soon_threadsafe``."""
    loop, thread = _LOOP, _THREAD
    if loop is None or loop.is_closed() or thread is None or not thread.is_alive():
        return
    end = time.monotonic() + wait_s
    try:
        asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=wait_s)
    except Exception:  # noqa: BLE001 - exiting anyway: a stuck task must not hang the exit
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=max(0.0, end - time.monotonic()))
    while loop.handing_over() and time.monotonic() < end:
        time.sleep(0.001)
    if not thread.is_alive() and not loop.handing_over():
        loop.close()


def _after_fork_in_child() -> None:
    """A forked child has the loop object but not its thread: it makes its own."""
    global _LOOP, _THREAD, _LOOP_LOCK
    _LOOP, _THREAD, _LOOP_LOCK = None, None, threading.Lock()


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
