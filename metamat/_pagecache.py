"""Page-cache eviction and residency, for benchmarks and tests (not used by loading itself).

``evict(paths)`` drops the pages of files (or of every file under directories) from the page
cache without privileges: ``fsync`` (dirty pages cannot be dropped) then
``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file. It never writes
``/proc/sys/vm/drop_caches``: that empties the whole machine's cache, which on a shared box
disturbs everyone else's measurements. The advice is best effort (a file system may ignore
it, and pages mapped by a process stay), so callers check the result: ``resident(paths)``
is the fraction of the files' pages in the page cache, counted with ``mincore`` on a mapping
of each file (the C++ reader's own probe, ``_C.resident_fraction``, which ``io="auto"`` uses
to choose direct or buffered reads); no data is read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, List, Union

__all__ = ["Eviction", "evict", "files_of", "resident"]

Paths = Union[str, "os.PathLike[str]", Iterable[Union[str, "os.PathLike[str]"]]]


def files_of(paths: Paths) -> List[str]:
    """The regular files named by ``paths`` (a path or several; directories walked), sorted."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            out += [os.path.join(d, n) for d, _, ns in os.walk(p) for n in ns]
        elif os.path.isfile(p):
            out.append(p)
    return sorted(f for f in out if os.path.isfile(f))


def resident(paths: Paths) -> float:
    """Fraction (by bytes) of the pages of ``paths`` that are in the page cache, from
    ``mincore``; 1.0 for no bytes, -1.0 when some file cannot be probed."""
    from ._ext import core

    total = hit = 0.0
    for f in files_of(paths):
        n = os.path.getsize(f)
        if n == 0:
            continue
        frac = core().resident_fraction(f)
        if frac < 0:
            return -1.0
        total += n
        hit += frac * n
    return hit / total if total else 1.0


@dataclass
class Eviction:
    """What :func:`evict` did: the residency of the files before and after, and how."""

    files: int
    nbytes: int
    before: float
    after: float
    how: str = "fsync + posix_fadvise(DONTNEED)"

    @property
    def ok(self) -> bool:
        """At most 1% of the pages stayed cached."""
        return 0 <= self.after <= 0.01

    def __str__(self) -> str:
        return (f"{self.how} on {self.files} file(s), {self.nbytes / 2**30:.2f} GiB: "
                f"resident {self.before:.3f} -> {self.after:.3f} (mincore)")


def evict(paths: Paths, check: bool = True) -> Eviction:
    """Drop the page-cache pages of ``paths`` (files, or directories walked). With ``check``
    the residency before and after is measured (``mincore``); without, both read as nan."""
    files = files_of(paths)
    before = resident(files) if check else float("nan")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    after = resident(files) if check else float("nan")
    return Eviction(len(files), sum(os.path.getsize(f) for f in files), before, after)
