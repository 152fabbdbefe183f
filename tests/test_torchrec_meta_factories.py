"""MetaFactories: factory calls of the opening thread go to meta; nothing else changes."""
import copy
import pickle
import threading

import pytest
import torch

pytest.importorskip("torchrec")

from metamat.models.torchrec import meta_factories  # noqa: E402
from metamat.models.torchrec.meta_factories import MetaFactories, _uvm_ops  # noqa: E402

_NAMES = ("empty", "zeros", "ones", "full", "rand", "randn", "empty_strided", "tensor",
          "as_tensor", "arange", "zeros_like", "ones_like", "full_like")
# torch's own functions, whatever the torch namespace holds now
_TORCH = {name: getattr(torch._C._VariableFunctions, name) for name in _NAMES}


def _originals():
    return {name: getattr(torch, name) for name in _NAMES}


@pytest.fixture(autouse=True)
def _torch_is_itself_around_each_test():
    assert _originals() == _TORCH and meta_factories._users == 0
    yield
    assert _originals() == _TORCH, "stand-ins left installed"
    assert meta_factories._users == 0 and not meta_factories._installed


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
        held = torch.as_tensor([1.5, 2.5], device="meta")  # floating, but explicitly on meta
        assert held.device.type == "meta" and held._metamat_value.tolist() == [1.5, 2.5]
        big = torch.zeros(2, device="meta")  # a floating factory: a table, value not kept
        assert not hasattr(big, "_metamat_value")
        assert torch.zeros(3, out=buf) is buf and buf.tolist() == [0, 0, 0]  # out= is kept
        assert torch.zeros(2, dtype=torch.int32, device="meta")._metamat_value.tolist() == [0, 0]
        # *_like of a meta tensor: integer results remember their value, floating ones not
        counts = torch.empty(3, dtype=torch.int64, device="meta")
        assert torch.zeros_like(counts)._metamat_value.tolist() == [0, 0, 0]
        assert torch.ones_like(counts)._metamat_value.tolist() == [1, 1, 1]
        assert torch.full_like(counts, 7)._metamat_value.tolist() == [7, 7, 7]
        assert not hasattr(torch.zeros_like(torch.empty(3, device="meta")), "_metamat_value")
        assert torch.zeros_like(ints).device.type == "cpu"  # a real input: nothing changes
        # a record is only good while the tensor is unwritten: on meta fill_ does nothing
        # (fbgemm's cache state is torch.zeros(...).fill_(-1))
        state = torch.zeros(2, dtype=torch.int64, device="meta")
        kept = torch.zeros(2, dtype=torch.int64, device="meta")
        state.fill_(-1)
        assert meta_factories.recorded_value(state) is None
        assert meta_factories.recorded_value(kept).tolist() == [0, 0]
        view_written = torch.zeros(2, dtype=torch.int64, device="meta")
        view_written[0] = 5  # through a view: the version counter is shared
        assert meta_factories.recorded_value(view_written) is None
    assert torch.zeros(3).device.type == "cpu"


def test_cuda_flag_sends_cuda_factories_and_uvm_ops_to_meta():
    proto = torch.zeros(1, dtype=torch.float16)  # on the CPU: fbgemm's op would answer on it
    packets = _uvm_ops()  # torch's packets, taken outside the window
    with MetaFactories(cuda=True):
        assert torch.zeros(3, device="cuda:0").device.type == "meta"
        assert torch.empty(2, device=torch.device("cuda")).device.type == "meta"
        ops = _uvm_ops()
        if "new_unified_tensor" in ops:
            t = torch.ops.fbgemm.new_unified_tensor(proto, [3, 4], False)
            assert t.device.type == "meta" and t.shape == (3, 4) and t.dtype == torch.float16
            assert ops["new_unified_tensor"] is not packets["new_unified_tensor"]  # a stand-in
            # whose attributes are the packet's: its overloads are torch's, not redirected
            assert ops["new_unified_tensor"].default is packets["new_unified_tensor"].default
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


def test_copies_and_pickles_of_a_stand_in_are_torchs_originals():
    with MetaFactories():
        stand_in = torch.zeros
        assert stand_in is not _TORCH["zeros"] and stand_in.__name__ == "zeros"
        assert copy.copy(stand_in) is _TORCH["zeros"]
        assert copy.deepcopy(stand_in) is _TORCH["zeros"]
        assert pickle.loads(pickle.dumps(stand_in)) is _TORCH["zeros"]
        with pytest.raises(AttributeError):
            getattr(stand_in, "no_such_attribute")
    blank = object.__new__(meta_factories._Forwarder)  # as a copier's first step makes one
    assert not hasattr(blank, "__wrapped__")  # an AttributeError, not a recursion
    packet = torch.ops.aten.add  # an op packet, as fbgemm's UVM factories are
    stand_in = meta_factories._Forwarder(packet, True)
    assert copy.copy(stand_in) is packet and copy.deepcopy(stand_in) is packet


def test_closing_from_another_thread_or_twice_keeps_the_count_right():
    ctx = MetaFactories()
    ctx.__enter__()
    with pytest.raises(RuntimeError, match="already open"):
        ctx.__enter__()
    t = threading.Thread(target=ctx.__exit__, args=(None, None, None))
    t.start()
    t.join()
    assert torch.zeros(1).device.type == "cpu"  # this thread's entry went with it
    ctx.__exit__(None, None, None)  # nothing left to undo
    assert meta_factories._users == 0
    with ctx:  # reusable once closed
        assert torch.zeros(1).device.type == "meta"


def test_a_failed_install_leaves_nothing_behind(monkeypatch):
    class Unsettable:  # a namespace whose attribute cannot be replaced
        new_unified_tensor = staticmethod(_TORCH["zeros"])  # a declared patch site's name

        def __setattr__(self, name, value):
            raise TypeError("read-only")

    ns = Unsettable()
    real_uvm_ops = meta_factories._uvm_ops
    monkeypatch.setattr(meta_factories, "_uvm_ops",
                        lambda: {"new_unified_tensor": ns.new_unified_tensor})
    monkeypatch.setattr(torch.ops, "fbgemm", ns, raising=False)
    with pytest.raises(TypeError, match="read-only"):
        with MetaFactories():
            pass
    monkeypatch.setattr(meta_factories, "_uvm_ops", real_uvm_ops)
    assert _originals() == _TORCH  # the torch names set before the failure were put back


def test_nested_contexts_the_innermost_decides():
    with MetaFactories(cuda=True):
        assert torch.zeros(2, device="cuda").device.type == "meta"
        with MetaFactories():  # no cuda: a CUDA factory runs as asked
            assert torch.zeros(2).device.type == "meta"
            if not torch.cuda.is_available():
                with pytest.raises((RuntimeError, AssertionError)):
                    torch.zeros(2, device="cuda")
        assert torch.zeros(2, device="cuda").device.type == "meta"
