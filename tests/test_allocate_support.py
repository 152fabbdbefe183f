"""The allocation's twins, and fill_support: the bytes of a storage no target covers are
zeroed, covered bytes are left to their targets, and a storage its targets cover whole is
not written at all."""
from __future__ import annotations

import pytest
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


def test_a_host_tensor_at_an_address_aliases_it_and_keeps_its_owner_alive():
    """host_tensor_at: the CPU view metamat makes of host-mapped unified memory (fbgemm < 1.8
    gives none) views the owner's bytes as the CUDA tensor does, and holds the owner."""
    import gc
    import weakref

    from metamat import _C
    from metamat.allocate import host_tensor_at

    owner = torch.arange(24, dtype=torch.float32).untyped_storage()
    like = torch.empty(0).set_(owner, 2, (3, 4), (4, 1))  # a view from element 2
    view = host_tensor_at(owner.data_ptr(), owner, like)
    assert view.device.type == "cpu" and view.shape == (3, 4) and view.stride() == (4, 1)
    assert torch.equal(view, torch.arange(2, 14, dtype=torch.float32).view(3, 4))
    view[0, 0] = -1.0  # the same bytes
    assert torch.empty(0).set_(owner)[2] == -1.0
    probe = weakref.ref(owner)
    del owner, like
    gc.collect()
    assert probe() is not None  # the view keeps its owner
    del view
    gc.collect()
    assert probe() is None
    # no CUDA backend, or an address CUDA does not know: no host pointer
    assert _C.host_pointer(torch.zeros(4).data_ptr()) == 0


@pytest.mark.cuda
def test_unified_memory_has_a_host_view_on_a_gpu():
    """fbgemm's host-mapped (malloc + cudaHostRegister) and managed memory both get a CPU
    view of the same bytes, also where fbgemm's uvm_to_cpu refuses host-mapped memory
    (before 1.8); a page-locked tensor's host pointer is its own; device memory has none."""
    pytest.importorskip("fbgemm_gpu")
    from metamat import _C
    from metamat.allocate import UVM, UVM_HOST_MAPPED, host_alias

    if not torch.cuda.is_available() or not _C.cuda_compiled():
        pytest.skip("needs a GPU and metamat's CUDA backend")
    dev = torch.device("cuda", torch.cuda.current_device())
    groups = [StorageGroup(1, 4096, kind="zeros", memory=UVM_HOST_MAPPED),
              StorageGroup(2, 4096, kind="zeros", memory=UVM)]
    alloc = allocate(groups, dev)
    want = (torch.arange(4096) % 251).to(torch.uint8)
    for k in (1, 2):
        host = alloc.full(k)
        assert host.device.type == "cpu"
        host.copy_(want)  # written by the host, read by the GPU
        on_gpu = torch.empty(0, dtype=torch.uint8, device=dev).set_(alloc.storages[k])
        assert torch.equal(on_gpu.cpu(), want), k
        alias = host_alias(on_gpu)
        assert alias is not None and alias.data_ptr() == host.data_ptr(), k
    pinned = torch.empty(64, pin_memory=True)
    assert _C.host_pointer(pinned.data_ptr()) == pinned.data_ptr()
    assert _C.host_pointer(torch.empty(64, device=dev).data_ptr()) == 0


def test_a_broadcast_value_is_filled_in_place_and_a_real_one_copied():
    """"values" storages: a broadcast scalar (an LXU cache's -1s, built as one element) is
    written by a fill where the storage lives; a real tensor is copied; bytes past either are
    zeroed."""
    from metamat.support import is_broadcast

    minus = torch.tensor(-1, dtype=torch.int64).expand(3, 4)
    real = torch.arange(6, dtype=torch.int32)
    groups = [StorageGroup(1, 3 * 4 * 8 + 16, kind="values"), StorageGroup(2, 24, kind="values")]
    groups[0].value, groups[1].value = minus, real
    assert is_broadcast(minus) and not is_broadcast(real)
    assert not is_broadcast(torch.tensor(5).expand(1))  # one element: nothing to gain
    alloc = allocate(groups, torch.device("cpu"))
    for g in groups:
        alloc.full(g.key).fill_(0xAB)
    written = fill_support(groups, [], alloc)
    assert written == groups[0].nbytes + groups[1].nbytes
    one = alloc.full(1)
    assert one[:96].view(torch.int64).eq(-1).all() and one[96:].eq(0).all()
    assert torch.equal(alloc.full(2).view(torch.int32), real)
