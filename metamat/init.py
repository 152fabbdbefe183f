"""Fill stage, init: pack blocks into Segments and run the fused engine, one call per device.

Public API: :func:`fill_` and :func:`fill_many_`. The value of element (r, c) of table ``key``
depends only on (seed, key, global r, global c, distribution), so any block at any offset fills
to exactly its slice of the whole table, on CPU or CUDA, with any number of threads.
"""
from __future__ import annotations

import collections
import math
import struct
import threading
from typing import Iterable, Sequence, Tuple

import numpy as np
import torch

from ._ext import core
from .dtypes import CODES as _DTYPE_CODES
from .keys import philox_key
from .spec import Dist

__all__ = ["fill_", "fill_many_", "SEGMENT_DTYPE", "pack_item"]

# Mirrors csrc/include/metamat/fill.h `struct Segment` (128 bytes). `launch` (LaunchInfo) belongs to
# the core's CUDA launch and stays zero here.
SEGMENT_DTYPE = np.dtype(
    [
        ("ptr", "<u8"), ("rows", "<i8"), ("cols", "<i8"), ("row_stride", "<i8"),
        ("row_offset", "<i8"), ("col_offset", "<i8"), ("key", "<u8"), ("dtype", "<i4"),
        ("kind", "<i4"), ("p", "<f4", (4,)), ("clamp", "<f4", (2,)), ("launch", "<i8", (5,)),
    ]
)
assert SEGMENT_DTYPE.itemsize == 128


Item = Tuple[torch.Tensor, Dist, str, int, int]


_F32 = struct.Struct("<f")


def _f32(x: float) -> float:
    """``x`` rounded to float32 (nearest even), as a Python float; beyond float32's range +-inf
    as NumPy gives. ~10x cheaper than NumPy scalars, which matters for 10,000 tables. Sums of
    float32 values taken in double and rounded once equal the float32 sum (53 >= 2 * 24 + 2)."""
    try:
        return _F32.unpack(_F32.pack(float(x)))[0]  # float(): a custom Dist's ints
    except OverflowError:
        return float(np.float32(x))


def dist_params(dist: Dist) -> Tuple[int, Tuple[float, float, float, float], Tuple[float, float]]:
    """Distribution -> (kind, p0..p3, clamp) as float32 values the kernels use.

    Every derived parameter is rounded to float32 here, once, so all backends share it.
    """
    f32 = _f32
    kind, a0, a1, a2, a3 = dist.as_params()
    clamp = (0.0, 0.0)
    if kind == 0:  # uniform: a + u * (b - a), the width taken in float32
        lo = f32(a0)
        p = (lo, f32(f32(a1) - lo), 0.0, 0.0)
    elif kind == 1:  # normal: mean + std * z
        p = (f32(a0), f32(a1), 0.0, 0.0)
    elif kind == 2:  # truncated normal by inverse CDF, as torch.nn.init.trunc_normal_
        mean, std, a, b = a0, a1, a2, a3
        lo = math.erf((a - mean) / std / math.sqrt(2.0))  # 2*Phi(alpha) - 1
        hi = math.erf((b - mean) / std / math.sqrt(2.0))
        p = (f32(mean), f32(std * math.sqrt(2.0)), f32(lo), f32(f32(hi) - f32(lo)))
        clamp = (f32(a), f32(b))
    else:
        p = (f32(a0), 0.0, 0.0, 0.0)
    return kind, p, clamp


def _check_offset(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _block_geometry(t: torch.Tensor, row_offset: int, col_offset: int, where: str):
    """(rows, cols, row_stride, global row, global col) of a 1-D or 2-D destination."""
    if t.dim() == 1:
        # A 1-D tensor is one row of its table; its offset may be given as either argument.
        if row_offset and col_offset:
            raise ValueError(f"{where}: a 1-D tensor takes one offset (row_offset or col_offset)")
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{where}: 1-D tensor must be contiguous, stride is {t.stride(0)}")
        return 1, t.numel(), t.numel(), 0, row_offset + col_offset
    if t.dim() == 2:
        rows, cols = t.shape
        if cols > 1 and rows > 0 and t.stride(1) != 1:
            raise ValueError(f"{where}: column stride must be 1, got {t.stride(1)}")
        if rows > 1 and t.stride(0) < cols:
            raise ValueError(f"{where}: row stride {t.stride(0)} is smaller than cols {cols}")
        return rows, cols, max(t.stride(0), cols), row_offset, col_offset
    raise ValueError(f"{where}: expected a 1-D or 2-D tensor, got {t.dim()}-D")


def _pack(items: Sequence[Item], seed: int) -> np.ndarray:
    """Check every item, then pack them into a Segment array (one row per item)."""
    return _pack_columns(items, seed)[0]


# The dtype objects of codes 1, 2, ... (the C packer compares identities).
_DTYPES_BY_CODE = tuple(sorted(_DTYPE_CODES, key=_DTYPE_CODES.get))
assert [_DTYPE_CODES[d] for d in _DTYPES_BY_CODE] == list(range(1, len(_DTYPES_BY_CODE) + 1))


def _pack_columns(items: Sequence[Item], seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Segments of ``items`` and each item's device (-1: CPU, else the CUDA index).

    The compiled packer (``_C.pack_segments``, csrc/python/bindings_pack.cpp) takes plain items in
    C: tensors read through the same attributes, keys derived in C (csrc/python/keys.h). It hands
    any item it does not take back to `pack_item` here, which checks it the Python way and
    raises the error with its message; items are checked in order, and nothing is written
    to a tensor before all passed.
    """
    n = len(items)
    segs = np.zeros(n, dtype=SEGMENT_DTYPE)
    devs = np.full(n, -1, dtype=np.int64)
    dists = _distinct_dists(items, seed)
    C = None
    if dists is not None:
        try:
            C = core()
        except ImportError:  # no compiled core: every item the Python way
            C = None
    i = 0
    while i < n:
        if C is not None:
            i = C.pack_segments(items, i, segs.ctypes.data, devs.ctypes.data, torch.Tensor,
                                _DTYPES_BY_CODE, dists, seed)
            if i == n:
                break
        pack_item(items, i, seed, segs, devs)
        i += 1
    return segs, devs


def _distinct_dists(items: Sequence[Item], seed: int):
    """{id(dist): (kind, p0..p3, clamp_lo, clamp_hi)} for the compiled packer, or None when it
    cannot run (a bad seed, an item that is no sequence: Python raises those in order)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        return None
    try:
        objs = {id(it[1]): it[1] for it in items}
    except Exception:  # an item without a dist slot: the per-item path raises its error
        return None
    out = {}
    for k, d in objs.items():
        if isinstance(d, Dist):
            try:
                kind, p, clamp = dist_params(d)
            except Exception:  # raised again, in item order, by pack_item
                continue
            out[k] = (kind, *p, *clamp)
    return out


def pack_item(items: Sequence[Item], i: int, seed: int, segs: np.ndarray,
               devs: np.ndarray) -> None:
    """Check item i and pack it into segs[i], devs[i] (raises TypeError/ValueError): the packer
    in Python, one item at a time, which the compiled one (``_C.pack_segments``) equals byte
    for byte and error for error; it packs what the compiled one hands back."""
    item = items[i]
    if not isinstance(item, (tuple, list)) or len(item) != 5:
        raise TypeError(f"item {i}: expected (tensor, dist, key, row_offset, col_offset)")
    t, dist, key, ro, co = item
    where = f"item {i} (key {key!r})"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if not isinstance(dist, Dist):
        raise TypeError(f"{where}: dist must be a metamat distribution, got {type(dist).__name__}")
    if t.dtype not in _DTYPE_CODES:
        raise TypeError(f"{where}: dtype {t.dtype} is not supported "
                        "(float32, float16, bfloat16, float64)")
    if t.device.type == "meta":
        raise ValueError(f"{where}: tensor is on the meta device; allocate it first")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device {t.device} is not supported (cpu, cuda)")
    ro, co = _check_offset("row_offset", ro), _check_offset("col_offset", co)
    rows, cols, stride, gr, gc = _block_geometry(t, ro, co, where)
    kind, p, clamp = dist_params(dist)
    s = segs[i]
    s["ptr"], s["rows"], s["cols"], s["row_stride"] = t.data_ptr(), rows, cols, stride
    s["row_offset"], s["col_offset"] = gr, gc
    s["key"], s["dtype"], s["kind"] = philox_key(seed, key), _DTYPE_CODES[t.dtype], kind
    s["p"], s["clamp"] = p, clamp
    devs[i] = -1 if t.device.type == "cpu" else t.device.index


# Keeps pinned segment tables alive until the stream that reads them has passed. torch's caching
# host allocator only knows the copies torch issues itself, not the core's cudaMemcpyAsync, so
# we record our own event after the launch and drop the buffer (back to that allocator) once
# the event has fired: checked at the next CUDA fill, oldest first.
_in_flight: "collections.deque[Tuple[torch.cuda.Event, torch.Tensor]]" = collections.deque()
_in_flight_lock = threading.Lock()  # fill_many_ may run in several threads


def _reap_in_flight() -> None:
    with _in_flight_lock:
        while _in_flight and _in_flight[0][0].query():
            _in_flight.popleft()


def _staging(nbytes: int):
    """(host buffer as a NumPy uint8 array, the pinned tensor or None when pinning failed)."""
    try:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # no pinnable memory (driver refused, limits): pageable, still correct
        return np.empty(nbytes, dtype=np.uint8), None
    return pinned.numpy(), pinned


def _fill_cuda(C, device: torch.device, part: np.ndarray) -> None:
    """One launch for ``part`` on ``device``'s current stream, from a pinned segment table."""
    n = len(part)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        _reap_in_flight()
        host, pinned = _staging(part.nbytes)
        table = host.view(SEGMENT_DTYPE)
        table[:] = part
        scratch = torch.empty(part.nbytes, dtype=torch.uint8, device=device)
        addr = table.ctypes.data
        C.fill_cuda(addr, n, addr, scratch.data_ptr(), stream.cuda_stream)
        # The caching allocator reuses `scratch` only after this stream's work.
        scratch.record_stream(stream)
        if pinned is not None:  # pageable memory was consumed before fill_cuda returned
            done = torch.cuda.Event()
            done.record(stream)
            with _in_flight_lock:
                _in_flight.append((done, pinned))


def fill_many_(items: Iterable[Item], *, seed: int = 0) -> None:
    """Fill many blocks of many tables in place, one engine call per device.

    Args:
        items: ``(tensor, dist, key, row_offset, col_offset)`` tuples. Each tensor (1-D or 2-D,
            unit column stride, CPU or CUDA, float32/16, bfloat16 or float64) receives the block
            at global (row_offset, col_offset) of the table named ``key``.
        seed: the run's seed (0 <= seed < 2**64).

    Raises:
        TypeError, ValueError: on bad arguments, before anything is written.
    """
    items = items if isinstance(items, (list, tuple)) else list(items)
    segs, devs = _pack_columns(items, seed)  # validates every item before the first write
    if not len(segs):
        return
    nonempty = (segs["rows"] > 0) & (segs["cols"] > 0)
    C = core()
    for dev in np.unique(devs[nonempty]):
        part = segs[np.flatnonzero(nonempty & (devs == dev))]
        if dev < 0:
            C.fill_cpu(part.ctypes.data, len(part), torch.get_num_threads())
        else:
            if not C.cuda_compiled():
                raise RuntimeError("metamat was built without its CUDA backend; "
                                   "rebuild with METAMAT_CUDA=1 on a machine with nvcc")
            _fill_cuda(C, torch.device("cuda", int(dev)), part)


def fill_many_emulated_(items: Iterable[Item], *, seed: int = 0) -> None:
    """:func:`fill_many_` of CPU tensors through the CUDA launch run on the host (the kernel's
    segment table, block search and per-thread work: ``_C.fill_cuda_emulated``): what the
    emulated CUDA device of :mod:`metamat.emulation` does for device memory. Same values as
    :func:`fill_many_`, much slower; for tests."""
    items = items if isinstance(items, (list, tuple)) else list(items)
    segs, devs = _pack_columns(items, seed)
    if (devs >= 0).any():
        raise ValueError("fill_many_emulated_: CPU tensors only")
    nonempty = segs[(segs["rows"] > 0) & (segs["cols"] > 0)]
    if len(nonempty):
        core().fill_cuda_emulated(nonempty.ctypes.data, len(nonempty), False)


def fill_(tensor: torch.Tensor, dist: Dist, *, seed: int = 0, key: str, row_offset: int = 0,
          col_offset: int = 0) -> torch.Tensor:
    """Fill ``tensor`` in place as the block at (row_offset, col_offset) of table ``key``.

    The values are a pure function of ``(seed, key, global row, global column)``: the same
    bits on the CPU and CUDA, whatever the block's size, offsets or thread count, so any
    sharding of a table filled block by block equals the table filled whole.

    Args:
        tensor: a 1-D or 2-D tensor with unit column stride (float32, float16, bfloat16 or
            float64; CPU or CUDA). A 1-D tensor is one row of its table: give its offset as
            ``row_offset`` or ``col_offset``.
        dist: the distribution (:class:`metamat.Uniform`, :class:`metamat.Normal`, ...).
        seed: the run's seed (0 <= seed < 2**64).
        key: the table's name; different names give independent values.
        row_offset: the global row of ``tensor``'s first row.
        col_offset: the global column of its first column.

    Returns:
        ``tensor``.

    Raises:
        TypeError, ValueError: wrong dtype, non-unit column stride, meta tensor, bad offsets.

    Example:
        >>> import metamat, torch
        >>> whole = metamat.fill_(torch.empty(6, 4), metamat.Uniform(-1, 1), key="t")
        >>> part = metamat.fill_(torch.empty(2, 4), metamat.Uniform(-1, 1), key="t", row_offset=4)
        >>> torch.equal(whole[4:], part)
        True
    """
    fill_many_([(tensor, dist, key, row_offset, col_offset)], seed=seed)
    return tensor
