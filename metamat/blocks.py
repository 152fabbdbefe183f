"""Geometry: an N-D box of a global tensor as 2-D row blocks of its (rows, cols) view.

The fill engine and the loader work on 1-D and 2-D blocks. An N-D tensor (N > 2) is viewed as
``(prod(shape[:-1]), shape[-1])``; a box of it (a DTensor's local shard, or a saved chunk) is
one 2-D block of that view when it spans every middle dim fully (Shard(0), Shard(-1),
Replicate: the usual case), else one block per index of its leading partial dims. Element
(i0, ..., iN-1) of the tensor is element (flat(i0..iN-2), iN-1) of the view, so init values
stay a pure function of the global position whatever the sharding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = ["RowBlock", "row_blocks", "view_shape", "MAX_BLOCKS"]

# A box cut into more blocks than this is refused: it would mean a shard along a middle dim of
# a huge tensor, planned row by row.
MAX_BLOCKS = 1 << 16


@dataclass(frozen=True)
class RowBlock:
    """One 2-D block of the (rows, cols) view.

    Attributes:
        row, col: global position in the view.
        rows, cols: its shape.
        elem_offset: element offset of its first element inside the box's own row-major
            layout (where the box is stored contiguously).
    """

    row: int
    col: int
    rows: int
    cols: int
    elem_offset: int


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def view_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """(rows, cols) view of an N-D shape, N >= 2."""
    return _prod(shape[:-1]), int(shape[-1])


def row_blocks(global_shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
               limit: int = MAX_BLOCKS) -> List[RowBlock]:
    """Cut the box (offsets, sizes) of an N-D tensor (N >= 2) into 2-D blocks of its view.

    Args:
        global_shape: shape of the whole tensor.
        offsets, sizes: the box, one entry per dim.
        limit: most blocks allowed.

    Returns:
        Blocks in the box's row-major order (an empty box gives one empty block).

    Raises:
        ValueError: bad rank, a box outside the tensor, or more than ``limit`` blocks.
    """
    g, o, s = [list(map(int, x)) for x in (global_shape, offsets, sizes)]
    n = len(g)
    if n < 2 or len(o) != n or len(s) != n:
        raise ValueError(f"row_blocks: need N >= 2 and one offset/size per dim, got shape {g}, "
                         f"offsets {o}, sizes {s}")
    if any(a < 0 or b < 0 or a + b > c for a, b, c in zip(o, s, g)):
        raise ValueError(f"row_blocks: box offsets {o} sizes {s} outside shape {g}")
    cols = s[-1]
    if _prod(s) == 0:
        return [RowBlock(0, o[-1], 0, cols, 0)]
    # k: the first dim from which on dims k+1..n-2 are all full, so dims k..n-2 flatten to
    # one contiguous run of view rows for each index of dims 0..k-1.
    k = n - 2
    while k > 0 and s[k] == g[k]:
        k -= 1
    inner = _prod(g[k + 1:n - 1])  # view rows per unit of dim k
    run = s[k] * inner
    count = _prod(s[:k])
    if count > limit:
        raise ValueError(f"row_blocks: box offsets {o} sizes {s} of shape {g} needs {count} "
                         f"blocks (limit {limit}); shard a leading or the last dim instead")
    row_strides = [0] * (n - 1)  # view-row stride of each leading dim in the global tensor
    acc = 1
    for d in range(n - 2, -1, -1):
        row_strides[d] = acc
        acc *= g[d]
    blocks = []
    idx = [0] * k
    for i in range(count):
        rem = i
        for d in range(k - 1, -1, -1):
            idx[d] = rem % s[d]
            rem //= s[d]
        row = sum((o[d] + idx[d]) * row_strides[d] for d in range(k)) + o[k] * row_strides[k]
        blocks.append(RowBlock(row, o[-1], run, cols, i * run * cols))
    return blocks
