"""The CUDA launch's decomposition (tiles, per-block segment search, per-unit columns), run
on the host by ``_C.fill_cuda_emulated``, writes exactly what the CPU engine writes."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import metamat
from metamat._ext import core
from metamat.fill_init import _pack
from conftest import bits

DISTS = [metamat.Uniform(-1, 1), metamat.Normal(0, 2), metamat.TruncatedNormal(), metamat.Constant(7)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def emulate(items, seed=0):
    segs = _pack(items, seed)
    core().fill_cuda_emulated(segs.ctypes.data, len(segs))


def run_both(specs, seed):
    """specs: (rows, cols, pad, dtype_i, dist_i, r0, c0) -> (emulated, cpu) tensor lists."""
    out = []
    for _ in range(2):
        tensors, items = [], []
        for i, (rows, cols, pad, di, ki, r0, c0) in enumerate(specs):
            base = torch.full((rows, cols + pad), float("nan"), dtype=DTYPES[di])
            tensors.append(base)
            items.append((base[:, :cols], DISTS[ki], f"t{i % 7}", r0, c0))
        out.append((tensors, items))
    emulate(out[0][1], seed)
    metamat.fill_many_(out[1][1], seed=seed)
    return out[0][0], out[1][0]


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100), st.integers(0, 5),
                                st.integers(0, 3), st.integers(0, 3), st.integers(0, 10**6),
                                st.integers(0, 300)), min_size=1, max_size=12),
       seed=st.integers(0, 2**32))
def test_emulated_launch_equals_cpu(specs, seed):
    emulated, cpu = run_both(specs, seed)
    for a, b in zip(emulated, cpu):
        assert torch.equal(bits(a), bits(b))


def test_many_small_tables_across_tiles():
    # 3000 tables of 3 x 17 with odd offsets: tiles of 1024 units span many segments, and
    # empty tables sit between them.
    specs = [(3 if i % 11 else 0, 17, 1, i % 4, i % 4, i, (5 * i) % 64) for i in range(3000)]
    emulated, cpu = run_both(specs, 9)
    for a, b in zip(emulated, cpu):
        assert torch.equal(bits(a), bits(b))


def test_one_big_table_with_row_offset_past_2_32():
    emulated, cpu = run_both([(700, 333, 3, 0, 1, 2**33 + 5, 2**20 + 3)], 1)
    assert torch.equal(bits(emulated[0]), bits(cpu[0]))
