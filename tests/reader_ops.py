"""Helpers for the tests that drive the C++ reader (metamat._C) directly with op arrays."""
from __future__ import annotations

import os
import time

import numpy as np

RAW, F32, F16, BF16 = 0, 1, 2, 3
POISON = 0xA5


def ops(*rows) -> np.ndarray:
    """An (n, 9) int64 op array: file_index, file_offset, row_bytes, rows, src_stride,
    dst_stride, dst, src_dtype, dst_dtype per row."""
    return np.array(rows, dtype=np.int64).reshape(-1, 9)


def poisoned(nbytes: int) -> np.ndarray:
    return np.full(max(1, nbytes), POISON, dtype=np.uint8)


def addr(a: np.ndarray, off: int = 0) -> int:
    return a.ctypes.data + off


def expected_rows(data: bytes, off: int, row_bytes: int, rows: int, stride: int) -> bytes:
    return b"".join(data[off + r * stride: off + r * stride + row_bytes] for r in range(rows))


def random_file(tmp_path_factory, name: str, size: int, seed: int):
    """(path, bytes) of a file of ``size`` random bytes, written once per test module."""
    body = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    p = tmp_path_factory.mktemp(name) / "data.bin"
    p.write_bytes(body)
    return str(p), body


def os_threads(expect=None) -> int:
    """Threads of this process; with ``expect``, waits up to 2 s for at most that count: a
    joined thread can stay listed in /proc/self/task for a moment after pthread_join returns
    (the kernel reaps it after clearing its tid), while a leaked thread never goes. Callers
    check "no more than before", not "as many": a thread an earlier test left (a pool winding
    down) may end meanwhile, and an exact count then failed a test with no leak in it."""
    deadline = time.monotonic() + 2.0
    while True:
        n = len(os.listdir("/proc/self/task"))
        if expect is None or n <= expect or time.monotonic() > deadline:
            return n
        time.sleep(0.01)
