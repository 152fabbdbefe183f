"""The C++ XXH3-64 (csrc/io/xxh3.cpp) is bit-exact with the xxhash package: every length
0..4096 (all input-length classes: 0, 1-3, 4-8, 9-16, 17-128, 129-240, and the long loop
around its 64-byte stripes and 1024-byte blocks), random large lengths, and any split of the
stream into update() pieces; both the AVX2 and the scalar long loop."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

KERNELS = ["best", "scalar"]


@pytest.fixture(params=KERNELS)
def C(reader, request):
    reader.xxh3_kernel(request.param)
    yield reader
    reader.xxh3_kernel("best")


def _ref(b: bytes) -> int:
    return xxhash.xxh3_64_intdigest(b)


def test_every_length_to_4096(C):
    data = np.random.default_rng(1).integers(0, 256, 4096 + 64, dtype=np.uint8)
    raw = data.tobytes()
    for n in range(0, 4097):
        # an odd start too: the C++ side reads unaligned
        assert C.xxh3_64(data.ctypes.data, n) == _ref(raw[:n]), n
        assert C.xxh3_64(data.ctypes.data + 3, n) == _ref(raw[3:3 + n]), n


def test_random_large_lengths(C):
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (9 << 20) + 77, dtype=np.uint8)
    raw = data.tobytes()
    lengths = [4 << 20, (4 << 20) - 1, (4 << 20) + 1, 1 << 20, 9 << 20] + \
        [int(x) for x in rng.integers(4097, len(raw), 12)]
    for n in lengths:
        assert C.xxh3_64(data.ctypes.data, n) == _ref(raw[:n]), n


def test_arbitrary_split_points(C):
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 70000, dtype=np.uint8)
    raw = data.tobytes()
    for trial in range(300):
        n = int(rng.integers(0, len(raw))) if trial % 3 else int(rng.integers(0, 600))
        k = int(rng.integers(1, 12))
        splits = sorted(int(x) for x in rng.integers(0, n + 1, k))
        assert C.xxh3_64(data.ctypes.data, n, splits) == _ref(raw[:n]), (n, splits)


@pytest.mark.parametrize("piece", [1, 63, 64, 65, 240, 241, 255, 256, 257, 1023, 1024, 1025])
def test_fixed_piece_streams(C, piece):
    """Streams of equal pieces hit every buffer boundary (the 256-byte buffer, the stripe,
    the block)."""
    data = np.random.default_rng(4).integers(0, 256, 20000, dtype=np.uint8)
    raw = data.tobytes()
    for n in (0, 1, 240, 241, 256, 257, 1024, 1088, 2048, 4096, 19999):
        splits = list(range(piece, n, piece))
        assert C.xxh3_64(data.ctypes.data, n, splits) == _ref(raw[:n]), (n, piece)


def test_kernel_names(reader):
    assert reader.xxh3_kernel() in ("avx2", "scalar")
    with pytest.raises(ValueError):
        reader.xxh3_kernel("sse9")
