"""The allocation's twins, and fill_support: the bytes of a storage no target covers are
zeroed, covered bytes are left to their targets, and a storage its targets cover whole is
not written at all."""
from __future__ import annotations

import torch

from metamat.allocate import allocate
from metamat.plan import StorageGroup, Target
from metamat.support import _gaps, fill_support


def _target(alloc, key, offset_bytes, nbytes):
    full = alloc.full(key)
    view = full[offset_bytes:offset_bytes + nbytes]
    return Target(fqn=f"t{offset_bytes}", key="k", global_shape=(nbytes,), offsets=(0,),
                  local_shape=(nbytes,), dtype=torch.uint8, tensor=view)


def test_gaps_of_overlapping_unsorted_ranges():
    assert _gaps(64, [(16, 40), (8, 24)]) == [(0, 8), (40, 64)]
    assert _gaps(64, [(0, 64)]) == []
    assert _gaps(64, [(8, 16), (0, 40)]) == [(40, 64)]  # a range inside an earlier one
    assert _gaps(64, []) == [(0, 64)]
    assert _gaps(10, [(2, 3), (3, 5), (7, 8)]) == [(0, 2), (5, 7), (8, 10)]


def test_uncovered_bytes_zeroed_covered_ones_untouched():
    groups = [StorageGroup(1, 64, kind="targets"), StorageGroup(2, 32, kind="targets"),
              StorageGroup(3, 16, kind="zeros")]
    alloc = allocate(groups, torch.device("cpu"))
    assert not alloc.zeroed  # small storages are not born zero: their garbage must go
    for g in groups:
        alloc.full(g.key).fill_(0xAB)
    targets = [_target(alloc, 1, 16, 24), _target(alloc, 1, 8, 16),  # overlapping, unsorted
               _target(alloc, 2, 0, 32)]  # covers storage 2 whole
    written = fill_support(groups, targets, alloc)
    one = alloc.full(1)
    assert one[:8].eq(0).all() and one[40:].eq(0).all()
    assert one[8:40].eq(0xAB).all()  # the targets' bytes are theirs to write
    assert alloc.full(2).eq(0xAB).all()  # covered whole: not touched
    assert alloc.full(3).eq(0).all()
    assert written == 8 + 24 + 16


def test_a_parameter_twin_made_from_the_callers_view_is_its_own_object():
    from torch import nn

    from metamat.plan import storage_key

    old = nn.Parameter(torch.empty(4, 3, device="meta"))
    buf = torch.empty(5, device="meta")
    groups = [StorageGroup(storage_key(old), 48, kind="targets"),
              StorageGroup(storage_key(buf), 20, kind="targets")]
    alloc = allocate(groups, torch.device("cpu"))
    view = alloc.view(old)
    new = alloc.twin(old, view)
    assert type(new) is nn.Parameter and new.requires_grad and new is not view
    assert not view.requires_grad  # the caller's view stays a plain tensor to write into
    assert new.data_ptr() == view.data_ptr() and new.shape == view.shape
    with torch.no_grad():
        view.fill_(2.0)
    assert new.eq(2.0).all()
    assert alloc.twin(old) is new  # one twin per tensor, however asked
    plain_view = alloc.view(buf)
    plain = alloc.twin(buf, plain_view)  # a plain tensor's twin is a view of its own
    assert plain is not plain_view and plain.data_ptr() == plain_view.data_ptr()
