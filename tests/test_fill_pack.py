"""The compiled segment packer (init._pack_columns) equals the per-item Python packer
(init.pack_item), byte for byte and error for error (type and message, first bad item first)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import metamat
from metamat import init as fill_init
from metamat.dtypes import CODES
from metamat.init import SEGMENT_DTYPE, _pack, pack_item
from metamat.keys import philox_key


def reference_pack(items, seed):
    """The per-item packer (``init.pack_item``, the Python reference the compiled one falls
    back to), one item at a time."""
    segs = np.zeros(len(items), dtype=SEGMENT_DTYPE)
    devs = np.full(len(items), -1, dtype=np.int64)
    for i in range(len(items)):
        pack_item(items, i, seed, segs, devs)
    return segs


DISTS = [metamat.Uniform(-0.5, 2), metamat.Normal(1, 3), metamat.TruncatedNormal(0, 1, -1, 3),
         metamat.Constant(0.25), metamat.Zeros()]
DTYPES = list(CODES)


def tensor_of(kind, n, m, dtype):
    base = torch.zeros(n + 2, m + 3, dtype=dtype)
    return {0: base[:n, :m], 1: base[1:n + 1, 2:m + 2], 2: base[0, :m], 3: base[:0, :m],
            4: base[n + 1:n + 2, 1:m + 1]}[kind]


def outcome(fn, *args):
    try:
        return "ok", fn(*args).tobytes()
    except Exception as e:  # compared, type and message, against the reference packer
        return type(e), str(e)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 6),
                                st.integers(0, 3), st.integers(0, 4), st.integers(0, 5),
                                st.integers(0, 2**40), st.integers(0, 2**33)), max_size=20),
       seed=st.integers(0, 2**64 - 1))
def test_pack_equals_per_item_packer(specs, seed):
    items = []
    for kind, n, m, di, ki, name, ro, co in specs:
        t = tensor_of(kind, n, m, DTYPES[di])
        if t.dim() == 1:
            ro = 0
        items.append((t, DISTS[ki], f"k{name}", ro, co))
    got = outcome(_pack, items, seed)
    assert got[0] == "ok" and got == outcome(reference_pack, items, seed)


class StrKey(str):
    pass


GOOD = (torch.zeros(3, 4), metamat.Uniform(), "good", 0, 0)
BAD_ITEMS = {
    "not a tuple": "tensor",
    "short tuple": (torch.zeros(2),),
    "not a tensor": ([1.0], metamat.Uniform(), "k", 0, 0),
    "not a dist": (torch.zeros(2), "uniform", "k", 0, 0),
    "int dtype": (torch.zeros(2, dtype=torch.int32), metamat.Uniform(), "k", 0, 0),
    "meta": (torch.empty(2, 2, device="meta"), metamat.Uniform(), "k", 0, 0),
    "negative offset": (torch.zeros(2, 2), metamat.Uniform(), "k", -1, 0),
    "float offset": (torch.zeros(2, 2), metamat.Uniform(), "k", 0, 1.0),
    "bool offset": (torch.zeros(2, 2), metamat.Uniform(), "k", True, 0),
    "numpy offset": (torch.zeros(2, 2), metamat.Uniform(), "k", np.int64(3), 0),
    "column stride": (torch.zeros(4, 4).t(), metamat.Uniform(), "k", 0, 0),
    "3-D": (torch.zeros(2, 2, 2), metamat.Uniform(), "k", 0, 0),
    "1-D two offsets": (torch.zeros(4), metamat.Uniform(), "k", 1, 1),
    "1-D strided": (torch.zeros(8)[::2], metamat.Uniform(), "k", 0, 0),
    "key not str": (torch.zeros(2, 2), metamat.Uniform(), 7, 0, 0),
    "key unhashable": (torch.zeros(2, 2), metamat.Uniform(), ["k"], 0, 0),
}


@pytest.mark.parametrize("bad", list(BAD_ITEMS), ids=list(BAD_ITEMS))
@pytest.mark.parametrize("at", [0, 2])
def test_errors_match_per_item_packer(bad, at):
    items = [GOOD] * 3
    items[at] = BAD_ITEMS[bad]
    for seed in (5, -1):  # a bad seed too: which error comes first must not change
        got, want = outcome(_pack, items, seed), outcome(reference_pack, items, seed)
        assert got[0] != "ok" and got == want, (got, want)


def test_str_subclass_keys_and_repeats_and_empty():
    items = [(torch.zeros(2, 3), metamat.Normal(), StrKey("a"), 0, 0),
             (torch.zeros(2, 3), metamat.Normal(), "a", 2, 0),
             (torch.zeros(5), metamat.Constant(1), "b", 0, 3)]
    assert _pack(items, 9).tobytes() == reference_pack(items, 9).tobytes()
    assert len(_pack([], -1)) == 0  # no items: nothing checked, as before


def test_devices_column_and_no_nonempty():
    segs, devs = fill_init._pack_columns([GOOD, (torch.zeros(0, 3), metamat.Uniform(), "e", 0, 0)], 1)
    assert list(devs) == [-1, -1] and list(segs["rows"]) == [3, 0]
    fill_init.fill_many_([(torch.zeros(0, 3), metamat.Uniform(), "e", 0, 0)])  # nothing to do


def test_compiled_packer_keys_equal_keys_py():
    from metamat._ext import core

    names = ["", "a", "embedding_bags.t0.weight", "ü" * 40, "x" * 127, "y" * 128, "z" * 129,
             "w" * 300, "表" * 100]
    for seed in (0, 1, 2**63 + 5, 2**64 - 1):
        assert [core().philox_key(seed, n) for n in names] == [philox_key(seed, n) for n in names]


def test_compiled_packer_takes_plain_items_and_leaves_odd_ones_to_python():
    from metamat._ext import core

    items = [GOOD, (torch.zeros(6), metamat.Normal(), "bias", 0, 4),
             (torch.zeros(2, 2, 2), metamat.Normal(), "odd", 0, 0), GOOD]
    segs = np.zeros(4, SEGMENT_DTYPE)
    devs = np.zeros(4, np.int64)
    dists = fill_init._distinct_dists(items, 3)
    assert core().pack_segments(items, 0, segs.ctypes.data, devs.ctypes.data, torch.Tensor,
                                fill_init._DTYPES_BY_CODE, dists, 3) == 2
    assert segs[:2].tobytes() == reference_pack(items[:2], 3).tobytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here: fallback not reachable")
def test_staging_falls_back_to_pageable_memory():
    host, pinned = fill_init._staging(3 * SEGMENT_DTYPE.itemsize)
    assert pinned is None and host.nbytes == 384 and host.view(SEGMENT_DTYPE).shape == (3,)
