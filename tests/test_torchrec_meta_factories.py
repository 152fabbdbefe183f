"""MetaFactories: factory calls of the opening thread go to meta; nothing else changes."""
import threading

import pytest
import torch

pytest.importorskip("torchrec")

from metamat.models.torchrec.meta_factories import MetaFactories, _uvm_ops  # noqa: E402

_NAMES = ("empty", "zeros", "ones", "full", "rand", "randn", "empty_strided", "tensor",
          "as_tensor", "arange")


def _originals():
    return {name: getattr(torch, name) for name in _NAMES}


def test_redirects_floating_keeps_integer_and_records_small_meta_values():
    buf = torch.ones(3)
    with MetaFactories():
        assert torch.zeros(3).device.type == "meta"
        assert torch.randn(2, 2, device="cpu").device.type == "meta"
        assert torch.full((2,), 1.5).device.type == "meta"
        ints = torch.zeros(4, dtype=torch.int64)
        assert ints.device.type == "cpu"  # TBE constructors read integer metadata back
        assert torch.full((2,), 7).device.type == "cpu"  # an int fill makes an int tensor
        dims = torch.tensor([3, 5], device="meta")
        assert dims.device.type == "meta" and dims._metamat_value.tolist() == [3, 5]
        ar = torch.arange(4, device="meta")
        assert ar._metamat_value.tolist() == [0, 1, 2, 3]
        assert torch.zeros(3, out=buf) is buf and buf.tolist() == [0, 0, 0]  # out= is kept
        assert torch.zeros(2, dtype=torch.int32, device="meta")._metamat_value.tolist() == [0, 0]
    assert torch.zeros(3).device.type == "cpu"


def test_cuda_flag_sends_cuda_factories_and_uvm_ops_to_meta():
    proto = torch.zeros(1, dtype=torch.float16)  # on the CPU: fbgemm's op would answer on it
    with MetaFactories(cuda=True):
        assert torch.zeros(3, device="cuda:0").device.type == "meta"
        assert torch.empty(2, device=torch.device("cuda")).device.type == "meta"
        ops = _uvm_ops()
        if "new_unified_tensor" in ops:
            t = torch.ops.fbgemm.new_unified_tensor(proto, [3, 4], False)
            assert t.device.type == "meta" and t.shape == (3, 4) and t.dtype == torch.float16
            assert torch.ops.fbgemm.new_unified_tensor.default is ops["new_unified_tensor"].default
    with MetaFactories():  # without cuda=True the op runs as it is
        if "new_unified_tensor" in _uvm_ops():
            assert torch.ops.fbgemm.new_unified_tensor(proto, [2], False).device.type == "cpu"
    if "new_unified_tensor" in _uvm_ops():
        assert type(torch.ops.fbgemm.new_unified_tensor).__name__ == "OpOverloadPacket"


def test_other_threads_are_untouched_and_originals_come_back():
    before = _originals()
    opened, release, seen = threading.Event(), threading.Event(), {}

    def builder():
        with MetaFactories():
            seen["builder"] = torch.zeros(2).device.type
            opened.set()
            release.wait(10)

    t = threading.Thread(target=builder)
    t.start()
    assert opened.wait(10)
    seen["other"] = torch.zeros(2).device.type  # while the builder's context is open
    assert torch.zeros is not before["zeros"]  # installed...
    release.set()
    t.join()
    assert seen == {"builder": "meta", "other": "cpu"}
    assert _originals() == before  # ...and gone with the last user


def test_overlapping_contexts_in_two_threads_and_failures_restore():
    before = _originals()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with MetaFactories():
            a_in.set()
            b_in.wait(10)
        a_out.set()  # a leaves first; b's context must still work

    def b():
        a_in.wait(10)
        with MetaFactories():
            b_in.set()
            a_out.wait(10)
            seen["b"] = torch.ones(1).device.type
        seen["b_after"] = torch.ones(1).device.type

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert seen == {"b": "meta", "b_after": "cpu"}
    assert _originals() == before
    with pytest.raises(ValueError):
        with MetaFactories():
            with MetaFactories(cuda=True):
                raise ValueError("boom")
    assert _originals() == before


def test_a_replacement_made_meanwhile_is_kept():
    original = torch.zeros

    def theirs(*args, **kwargs):
        return original(*args, **kwargs)

    try:
        with MetaFactories():
            torch.zeros = theirs
        assert torch.zeros is theirs
    finally:
        torch.zeros = original


def test_torch_device_context_still_redirects_after_a_window():
    """``with torch.device(...)`` caches its factory set at first use; filled inside the
    window it would hold the stand-ins and stop redirecting the originals afterwards."""
    from torch.utils._device import _device_constructors

    _device_constructors.cache_clear()
    with MetaFactories():
        with torch.device("meta"):  # torch's first use of the cache: inside the window
            assert torch.ones(2).device.type == "meta"
    with torch.device("meta"):
        assert torch.zeros(2).device.type == "meta"
