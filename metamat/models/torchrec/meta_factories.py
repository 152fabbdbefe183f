"""Keep a model under construction on meta without losing its small metadata.

While :class:`MetaFactories` is active in a thread, that thread's calls of torch's factory
functions are redirected:

* floating-point factories aimed at the CPU (``torch.randn(n)``, ``torch.zeros(n)``) go to
  meta: they are tables and optimizer state;
* integer factories keep their device: TBE constructors read offsets back;
* small tensors the caller explicitly puts on meta from data or integer factories
  (``torch.tensor(dims, device="meta")``), and integer ``zeros_like``/``ones_like``/
  ``full_like`` of a meta tensor, stay meta but remember their value in ``_metamat_value``
  (a CPU tensor), which ``materialize`` copies in;
* with ``cuda=True``, floating factories aimed at a CUDA device and fbgemm's UVM factories
  (``torch.ops.fbgemm.new_unified_tensor`` / ``new_managed_tensor``) go to meta too.

Why not a ``TorchFunctionMode``: a mode sees *every* torch call of the thread, ~100 per table
while TorchRec builds a DMP (tensor properties, ``view``, ``size``, ...), at ~2-4 µs each —
~300 µs per table, a third of ``shard_on_meta`` (measured, 2,000 tables), for ~0.1 factory
call per table. Instead the factory functions themselves (``torch.empty``, ``zeros``, ...,
the names in ``tbe.FACTORIES``, :data:`RECORDED` and :data:`LIKE`) are replaced in the
``torch`` namespace by forwarders while at least one thread has the context open; a forwarder
acts only for a thread that opened it and calls the original for every other thread, so the
effect stays thread-local as a mode's is. The originals are put back when the last user
leaves (unless someone replaced them meanwhile; then theirs is kept). Coverage equals the
mode's for code that calls ``torch.zeros(...)`` through the namespace, which is how torch,
TorchRec and fbgemm call them (checked: no ``from torch import zeros`` in torchrec 1.8.0 /
fbgemm-gpu 1.8.0).
The price: while a ``shard_on_meta`` runs, *other* threads that look those functions up get
the stand-ins (which call the originals for them); one that compiles code naming them at that
moment sees a Python callable, not torch's builtin (``torch.jit.script`` of a function that
calls ``torch.zeros`` or ``torch.zeros_like`` fails to compile then; ``torch.compile`` traces
through it), and an identity test such as ``f is torch.zeros_like`` is false. Copying a
stand-in gives the original; pickling one pickles the original (torch's functions by name;
fbgemm's op packets do not pickle, stand-in or not).

Where it differs from a mode, for code that mixes them:

* only calls through the namespace are seen: a reference taken before the window
  (``zeros = torch.zeros``) or an op overload (``torch.ops.fbgemm.new_unified_tensor.default``)
  runs unredirected — torch, TorchRec and fbgemm call the names and the op packets;
* a ``with torch.device(...)`` or ``TorchFunctionMode`` opened *inside* the window sees the
  call after the redirect (a mode would see it before ours); nested ``MetaFactories`` do not
  combine: the innermost decides;
* if other code replaces one of the names during the window, its replacement is kept at the
  end; if it later puts back what it found (our stand-in), the stand-in stays, forwarding to
  torch's original for every thread (harmless, one Python call more).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .tbe import FACTORIES, floating_factory_call

__all__ = ["LIKE", "MetaFactories", "RECORDED", "meta_with_value", "recorded_value",
           "uvm_factory_on_meta"]

_META = torch.device("meta")
# Factories whose small meta results remember their value (see the module docstring).
RECORDED = (torch.tensor, torch.as_tensor, torch.arange)
# ``*_like`` factories follow their input's device: on a meta input they make meta tensors of
# known value (fbgemm's ``last_uvm_cache_print_state = zeros_like(uvm_cache_stats)``). Their
# integer results are recorded like the others', so a TBE built here needs no rebuild to
# know its metadata (walk._known_values).
LIKE = (torch.zeros_like, torch.ones_like, torch.full_like)
_RECORD_MAX_NUMEL = 1 << 20
# Small floating tensors of a constant other than zero are metadata too (fbgemm's max_counter
# = ones(1)): recorded even when sent to meta. Tables and optimizer state are larger, and
# zeros need no record (an unrecorded floating storage is zeroed).
_CONSTANT = (torch.ones, torch.full)
_CONSTANT_MAX_NUMEL = 64
_UVM_NAMES = ("new_unified_tensor", "new_managed_tensor", "new_host_mapped_tensor",
              "new_managed_tensor_meta")


def _is_cpu(device: Any) -> bool:
    if device is None:
        return True
    if isinstance(device, str):
        return device == "cpu" or device.startswith("cpu:")
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA device to torch's factories
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _uvm_ops() -> Dict[str, Any]:
    """fbgemm's UVM factory op packets by name; empty without fbgemm's ops."""
    out: Dict[str, Any] = {}
    ns = getattr(torch.ops, "fbgemm", None)
    for name in _UVM_NAMES:
        try:
            out[name] = getattr(ns, name)
        except (AttributeError, RuntimeError):  # torch.ops lookups raise without the library
            continue
    return out


def uvm_factory_on_meta(func: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """A meta tensor for a call of fbgemm's UVM factories (``new_unified_tensor(self, sizes,
    is_host_mapped)``, ``new_managed_tensor(self, sizes)``: a tensor of ``sizes`` with
    ``self``'s dtype), else None (not such a call: the caller runs the op)."""
    proto = args[0] if args else kwargs.get("self")
    sizes = args[1] if len(args) > 1 else kwargs.get("sizes")
    if not isinstance(proto, torch.Tensor) or sizes is None:
        return None
    return torch.empty(tuple(int(s) for s in sizes), dtype=proto.dtype, device=_META)


class _Forwarder:
    """Stands in for one factory while installed: the active context of the calling thread
    answers, or the original runs. Attributes (``__name__``, an op's ``.default``) are the
    original's."""

    __slots__ = ("__wrapped__", "_uvm")

    def __init__(self, original: Any, uvm: bool) -> None:
        self.__wrapped__ = original
        self._uvm = uvm

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = getattr(_local, "stack", None)
        if not active:
            return self.__wrapped__(*args, **kwargs)
        return active[-1].call(self.__wrapped__, self._uvm, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _Forwarder.__slots__:  # unset (copy's blank instance): no recursion
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __reduce__(self) -> Any:
        return self.__wrapped__.__reduce__()  # a pickle holds torch's original

    # copies are the original too (copy.copy of an op packet itself never returns)
    def __copy__(self) -> Any:
        return self.__wrapped__

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__wrapped__

    def __repr__(self) -> str:
        return f"<metamat forwarder of {self.__wrapped__!r}>"


_local = threading.local()  # .stack: the open MetaFactories of this thread, innermost last
_lock = threading.RLock()  # also held around a context's own open/close (re-entered inside)
_users = 0
# the patches in force while _users > 0 (declared patch sites: torch_upstream.FACTORY_NAMES,
# torchrec.upstream's fbgemm UVM ops; boundary.Patch)
_installed: List[Any] = []


def _install() -> None:
    global _users
    with _lock:
        if _users:
            _users += 1
            return
        from .. import torch_upstream as tu
        from ..boundary import resolve
        from . import upstream

        tu.require("factories")
        # torch's ``with torch.device(...)`` caches its factory set at first use: fill the
        # cache with the originals before they are replaced.
        tu.prime_device_constructors()
        targets: List[Tuple[Any, str, bool]] = [
            (tu, f.__name__, False) for f in (*FACTORIES, *RECORDED, *LIKE)]
        targets += [(upstream, name, True) for name in _uvm_ops()]
        try:
            for door, name, uvm in targets:
                owner = "torch" if door is tu else upstream.FBGEMM_OPS
                original = getattr(resolve(owner), name)
                _installed.append(door.apply(owner, name, _Forwarder(original, uvm),
                                             keep_foreign=True))
        except BaseException:
            _restore()  # all or nothing
            raise
        _users = 1  # counted once installed: a failure above leaves no user behind


def _restore() -> None:
    """Put the originals back where our stand-ins still are (someone else's replacement made
    meanwhile is kept: ``keep_foreign``). Called with ``_lock`` held."""
    for p in reversed(_installed):
        p.undo()
    _installed.clear()


def _uninstall() -> None:
    global _users
    with _lock:
        _users -= 1
        if not _users:
            _restore()


class MetaFactories:
    """Context manager: redirect this thread's factory calls to meta (module docstring).

    ``cuda``: also send floating factories aimed at a CUDA device, and fbgemm's UVM factories,
    to meta (the CUDA compute-device path of ``shard_on_meta``). Contexts nest; the innermost
    decides.
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self._stack: Optional[List["MetaFactories"]] = None  # the opening thread's, while open

    def __enter__(self) -> "MetaFactories":
        with _lock:  # two threads opening one instance: one wins, the other raises
            if self._stack is not None:
                raise RuntimeError("this MetaFactories is already open; open a new one to nest")
            _install()
            stack = getattr(_local, "stack", None)
            if stack is None:
                stack = _local.stack = []
            stack.append(self)
            self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        # the stack kept at entry: right even if closed from another thread; a second exit
        # (or a concurrent one) finds nothing to undo: the user count drops once
        with _lock:
            stack, self._stack = self._stack, None
            if stack is None:
                return
            try:
                stack.remove(self)
            finally:
                _uninstall()

    def _aimed_here(self, device: Any) -> bool:
        return _is_cpu(device) or (self.cuda and _is_cuda(device))

    def call(self, func: Callable, uvm: bool, args: tuple, kwargs: dict) -> Any:
        """Run one intercepted factory call ``func(*args, **kwargs)`` (``func``: torch's
        original) the way the module docstring says."""
        if uvm:
            out = uvm_factory_on_meta(func, args, kwargs) if self.cuda else None
            return out if out is not None else func(*args, **kwargs)
        redirected = False
        if self._aimed_here(kwargs.get("device")) and floating_factory_call(func, args, kwargs):
            kwargs = dict(kwargs, device=_META)
            redirected = True
        out = func(*args, **kwargs)
        if (
            type(out) is torch.Tensor
            and out.device.type == "meta"
            and 0 < out.numel() <= _RECORD_MAX_NUMEL
            and (not redirected and (func in RECORDED or not out.is_floating_point())
                 or func in _CONSTANT and out.numel() <= _CONSTANT_MAX_NUMEL)
        ):
            try:
                out._metamat_value = func(*args, **dict(kwargs, device="cpu"))
                out._metamat_version = out._version  # see recorded_value
            except Exception:  # noqa: BLE001 - value unknown; materialize reports it
                pass
        return out


def meta_with_value(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor like real tensor ``t`` that remembers ``t``'s value (``recorded_value``)."""
    out = torch.empty_like(t, device=_META)
    out._metamat_value = t.detach().to("cpu", copy=True)
    out._metamat_version = out._version
    return out


def recorded_value(t: Any) -> Optional[torch.Tensor]:
    """The value a stand-in recorded for meta tensor ``t``, or None: none was recorded, or
    ``t`` was written in place since (``torch.zeros(..., device="meta").fill_(-1)``, which
    fbgemm does for cache state: on meta the write does nothing, but it bumps ``_version``)."""
    d = getattr(t, "__dict__", None)
    v = d.get("_metamat_value") if d else None
    if not isinstance(v, torch.Tensor) or d.get("_metamat_version") != t._version:
        return None
    return v
