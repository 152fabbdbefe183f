"""Work counted, not timed: how many Python lines, Python calls and calls into C a call makes.

Counts are the same on an idle machine and on a busy one, so a growth check on them needs no
repeats, no fastest-of-N and no slack for other jobs (wall or CPU time on a shared 2-core box
failed CI that way). What they do not see: work inside one C call (a sort, ``x in list``,
``list.insert``, the C++ core's loops); tests that care add a count of their own for that
(elements shifted, chunks visited), and the bench (``bench/bench_scale.py``) keeps timing
the whole.

``count_work(fn, *args)`` runs ``fn`` once with the collector paused and returns
``(result, Work)``. ``growth(cost)`` is the marginal cost per item between the two largest
counts over that between the smallest two: 1.0 is linear, 4.0 is quadratic at a 4x step.
"""
from __future__ import annotations

import gc
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple


@dataclass
class Work:
    lines: int = 0     # Python line events
    calls: int = 0     # Python function calls
    c_calls: int = 0   # calls of C functions (builtins, methods, extension functions)

    @property
    def total(self) -> int:
        return self.lines + self.calls + self.c_calls


def count_work(fn: Callable, *args: Any, **kwargs: Any) -> Tuple[Any, Work]:
    """Run ``fn(*args, **kwargs)`` in this thread (and threads it starts), counting its work."""
    w = Work()

    def local(frame, event, arg):
        if event == "line":
            w.lines += 1
        return local

    def tracer(frame, event, arg):
        return local  # 'call' events are counted by the profiler below

    def profiler(frame, event, arg):
        if event == "call":
            w.calls += 1
        elif event == "c_call":
            w.c_calls += 1

    old_trace, old_prof = sys.gettrace(), sys.getprofile()
    old_thread_trace, old_thread_prof = threading.gettrace(), threading.getprofile()
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection's finalizers would run (and be counted) at random points
    threading.settrace(tracer)
    threading.setprofile(profiler)
    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(old_prof)
        sys.settrace(old_trace)
        threading.setprofile(old_thread_prof)
        threading.settrace(old_thread_trace)
        if was_enabled:
            gc.enable()
    return out, w


def growth(cost: Dict[int, float]) -> float:
    """Marginal cost per item between the two largest counts over the marginal cost per item
    between the smallest and the middle one (differences remove the fixed cost)."""
    (n0, c0), (nm, cm), (n1, c1) = sorted(cost.items())[:1] + sorted(cost.items())[-2:]
    first = (cm - c0) / (nm - n0)
    last = (c1 - cm) / (n1 - nm)
    return last / first if first > 0 else float("inf")


def work_growth(run: Callable[..., Any], counts: Sequence[int],
                prepare: Optional[Callable[[int], Any]] = None
                ) -> Tuple[Dict[str, float], Dict[int, Work]]:
    """``growth`` of each kind of work of ``run(n)`` (``run(prepare(n))`` with ``prepare``,
    which is not counted) over ``counts`` (at least three).

    Called once at the smallest count first (imports, caches and lazily built tables land
    there), then once per count, counted."""
    assert len(counts) >= 3

    def arg(n):
        return prepare(n) if prepare is not None else n

    run(arg(counts[0]))
    work = {}
    for n in counts:
        a = arg(n)
        work[n] = count_work(run, a)[1]
    g = {k: growth({n: getattr(w, k) for n, w in work.items()})
         for k in ("lines", "calls", "c_calls", "total")}
    return g, work
