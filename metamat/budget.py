"""The staging budget: how the host memory a load may use (``staging_bytes``) is split.

A load uses host memory for two things: per-thread bounce buffers of the C++ reader (dtype
conversion, coalesced strided reads, direct I/O) and, for device destinations, a ring of
(pinned) staging buffers the reader fills while the previous one is copied to the device.
:class:`StagingBudget` owns that split, so that the budget the user passes is what is used,
never more (torchsnapshot once shipped a sign bug in exactly this accounting). Between loads
the last staging ring is kept for the next one (``metamat.release_staging_memory``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

__all__ = ["StagingBudget", "MIN_BOUNCE", "MAX_BOUNCE", "MIN_RING_BUFFER", "groups_within"]

MIN_BOUNCE = 16 << 10  # below this a bounce buffer costs a syscall per few rows
MAX_BOUNCE = 8 << 20  # beyond this a thread's buffer stops paying off (and pins memory)
MIN_RING_BUFFER = 64 << 10  # smaller device copies are dominated by their launch
_ALIGN = 4096  # ring buffers and bounce buffers are whole pages (direct I/O, pinning)


def groups_within(sizes: Sequence[int], cap: int) -> List[List[int]]:
    """Indexes of ``sizes``, in order, cut into consecutive groups whose sizes add up to at
    most ``cap`` (a single item larger than ``cap`` is a group of its own)."""
    groups: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if cur and used + n > cap:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def _floor(n: int) -> int:
    return n // _ALIGN * _ALIGN


@dataclass(frozen=True)
class StagingBudget:
    """A split of ``total`` bytes of host memory.

    Attributes:
        total: the budget (``staging_bytes``).
        threads: reader threads; each gets one bounce buffer.
        bounce_bytes: bytes of each reader thread's bounce buffer.
        ring: number of staging buffers (0: destinations are host memory, read in place).
        ring_bytes: bytes of each staging buffer.
    """

    total: int
    threads: int
    bounce_bytes: int
    ring: int = 0
    ring_bytes: int = 0

    @property
    def used(self) -> int:
        """Bytes this split allocates at most (never more than ``total``)."""
        return self.threads * self.bounce_bytes + self.ring * self.ring_bytes

    @classmethod
    def split(cls, total: int, threads: int, *, staged: bool, ring: int = 2) -> "StagingBudget":
        """Split ``total`` bytes for ``threads`` reader threads.

        Host destinations: the whole budget goes to bounce buffers (at most
        :data:`MAX_BOUNCE` each). Device destinations: a quarter to bounce buffers, the rest
        to ``ring`` staging buffers (so reading one overlaps copying the other).

        Args:
            total: bytes the load may use (``materialize(staging_bytes=...)``).
            threads: reader threads (>= 1).
            staged: the destinations are on a device (a ring is needed).
            ring: number of staging buffers when ``staged`` (>= 1).

        Returns:
            The split; ``used <= total``.

        Raises:
            ValueError: a non-positive argument, or a budget too small for the threads (the
                message says the smallest budget that works).
        """
        if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
            raise ValueError(f"staging_bytes must be a positive int, got {total!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"io_threads must be an int >= 1, got {threads!r}")
        if staged and ring < 1:
            raise ValueError(f"ring must be >= 1, got {ring}")
        need = threads * MIN_BOUNCE + (ring * MIN_RING_BUFFER if staged else 0)
        if total < need:
            raise ValueError(
                f"staging_bytes={total} is too small for {threads} reader thread(s)"
                + (f" and a ring of {ring} device staging buffers" if staged else "")
                + f": it needs at least {need} bytes")
        if not staged:
            bounce = max(MIN_BOUNCE, min(MAX_BOUNCE, _floor(total // threads)))
            return cls(total, threads, bounce)
        bounce = max(MIN_BOUNCE, min(MAX_BOUNCE, _floor(total // (4 * threads))))
        ring_bytes = _floor((total - threads * bounce) // ring)
        if ring_bytes < MIN_RING_BUFFER:  # the quarter was too generous for a small budget
            bounce = max(MIN_BOUNCE, min(MAX_BOUNCE,
                                         _floor((total - ring * MIN_RING_BUFFER) // threads)))
            ring_bytes = _floor((total - threads * bounce) // ring)
        return cls(total, threads, bounce, ring, ring_bytes)
