"""Sharding invariance (hypothesis): any split of a table fills to the whole table's slices."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import metamat
from conftest import bits

DISTS = st.sampled_from([metamat.Uniform(-1, 1), metamat.Normal(0, 0.1),
                         metamat.TruncatedNormal(0, 1, -2, 2), metamat.Constant(0.5)])
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64])


@st.composite
def splits(draw, n):
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))) - {n})
    return [0] + cuts + [n]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 140), r0=st.integers(0, 10**12),
       c0=st.integers(0, 5000), seed=st.integers(0, 2**64 - 1), dist=DISTS, dtype=DTYPES,
       data=st.data())
def test_any_split_fills_to_the_whole_tables_slices(rows, cols, r0, c0, seed, dist, dtype, data):
    whole = torch.empty(rows, cols, dtype=dtype)
    metamat.fill_(whole, dist, seed=seed, key="tbl", row_offset=r0, col_offset=c0)
    rs, cs = data.draw(splits(rows)), data.draw(splits(cols))
    items, blocks = [], []
    for i in range(len(rs) - 1):
        for j in range(len(cs) - 1):
            b = torch.full((rs[i + 1] - rs[i], cs[j + 1] - cs[j]), float("nan"), dtype=dtype)
            blocks.append((b, rs[i], cs[j]))
            items.append((b, dist, "tbl", r0 + rs[i], c0 + cs[j]))
    metamat.fill_many_(items, seed=seed)
    for b, i, j in blocks:
        assert torch.equal(bits(b), bits(whole[i:i + b.shape[0], j:j + b.shape[1]]))
