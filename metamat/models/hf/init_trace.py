"""A Hugging Face model's own init, decided per tensor before anything is allocated.

transformers initialises a model with ``initialize_weights``: a walk over the modules,
children first, calling each module's nearest ``PreTrainedModel``'s ``_init_weights(module)``
(Linear/Embedding normal(0, ``initializer_range``) and zero biases, padding rows zeroed,
norms ones, GPT-2's residual projections normal(0, range / sqrt(2 n_layer)), T5's scaled
attention, MoE experts and routers, rotary ``inv_freq`` recomputed, ...). Every transformers 5
``_init_weights`` writes through ``transformers.initialization``'s functions (``init.normal_``,
``init.zeros_``, ``init.copy_``, ...), and ``guard_torch_init_functions`` routes
``torch.nn.init`` calls through them.

:func:`trace` runs that same walk on the meta model with every parameter and buffer replaced by
a meta *proxy* of the tensor's global shape (one per registration, so a tie's two names are
told apart) and those functions replaced by recorders; a dispatch mode notes any other write
into a proxy (``weight.data.normal_()``, an in-place op, a reassigned tensor). Nothing is
allocated and no rank-local shape is ever seen, so what it finds is the same on every plan.
Each tensor's record then becomes a :class:`ModelInit`:

* **fused**: its last whole-tensor write is a known distribution (``normal_``, ``uniform_``,
  ``trunc_normal_``, ``constant_``/``ones_``/``zeros_``, and ``xavier_*``/``kaiming_*`` with
  the fans of the global shape), followed at most by zeroing one row (``padding_idx``): filled
  by the fused engine at global offsets, like every other rule;
* **run**: anything else (``copy_`` of a computed value such as a rotary ``inv_freq``,
  ``orthogonal_``, writes the recorders did not see): the ``_init_weights`` calls that wrote
  it are run again at fill time on a real CPU tensor of the *global* shape, under a torch seed
  keyed by ``(seed, fqn)``, with every other tensor of those modules a meta proxy; each rank
  keeps its block. Plan-invariant too, at the cost of the whole tensor in host memory for a
  moment.

A tie's value is its source's (``all_tied_weights_keys``: the target is overwritten by the tie
after init in transformers), so writes made through a tie target's name are ignored. Tensors
no ``_init_weights`` call writes are not covered here: in transformers they keep their
constructor's value, which metamat's other rules give (:mod:`metamat.models.module_values`).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ...errors import MissingValueError
from ...keys import module_seed
from ...plan import storage_key
from ...rng import seeded
from ...spec import Constant, Dist, Normal, TruncatedNormal, Uniform, Zeros
from .. import torch_upstream
from . import upstream

__all__ = ["ModelInit", "Trace", "trace"]

SlotKey = Tuple[int, str]  # (id(module), attribute name)

# The recorders replace module attributes of torch and transformers process-wide while a trace
# runs (as transformers' own guard_torch_init_functions does): one trace at a time.
_TRACING = threading.Lock()


@dataclass
class _Op:
    seq: int
    call: int
    fn: str  # an init function's name, or "write" (seen by the dispatch mode only)
    full: bool
    row: Optional[int]  # a whole row of a 2-D tensor written alone
    dist: Optional[Dist]


@dataclass
class ModelInit:
    """How the model's own init sets one tensor.

    Attributes:
        dist: the fused distribution (None: run).
        zero_row: a global row zeroed after ``dist`` (``padding_idx``).
        calls: indices of the ``_init_weights`` calls to run again (run only).
        how: a description for the Report.
    """

    dist: Optional[Dist]
    zero_row: Optional[int]
    calls: List[int] = field(default_factory=list)
    how: str = ""


def _fans(t: torch.Tensor) -> Tuple[int, int]:
    return torch_upstream.fan_in_and_fan_out(t)


def _dist_of(fn: str, a: Dict[str, Any], view: torch.Tensor) -> Optional[Dist]:
    """The distribution ``fn(view, **a)`` draws from, when it is one the engine fuses."""
    if a.get("generator") is not None:
        return None
    try:
        if fn == "normal_":
            return Normal(float(a["mean"]), float(a["std"]))
        if fn == "uniform_":
            return Uniform(float(a["a"]), float(a["b"]))
        if fn == "trunc_normal_":
            return TruncatedNormal(float(a["mean"]), float(a["std"]), float(a["a"]),
                                   float(a["b"]))
        if fn == "constant_":
            return Zeros() if float(a["val"]) == 0.0 else Constant(float(a["val"]))
        if fn == "zeros_":
            return Zeros()
        if fn == "ones_":
            return Constant(1.0)
        if fn in ("xavier_uniform_", "xavier_normal_"):
            fan_in, fan_out = _fans(view)
            std = float(a["gain"]) * math.sqrt(2.0 / float(fan_in + fan_out))
            if fn == "xavier_normal_":
                return Normal(0.0, std)
            bound = math.sqrt(3.0) * std
            return Uniform(-bound, bound)
        if fn in ("kaiming_uniform_", "kaiming_normal_"):
            fan = torch_upstream.correct_fan(view, a["mode"])
            gain = torch.nn.init.calculate_gain(a["nonlinearity"], a["a"])
            std = gain / math.sqrt(fan)
            if fn == "kaiming_normal_":
                return Normal(0.0, std)
            bound = math.sqrt(3.0) * std
            return Uniform(-bound, bound)
    except (ValueError, ZeroDivisionError, KeyError, TypeError):
        return None
    return None


def _is_zero(op: _Op) -> bool:
    return isinstance(op.dist, Constant) and op.dist.value == 0.0


def _written(func, args, kwargs) -> List[torch.Tensor]:
    out = []
    for i, a in enumerate(torch_upstream.op_arguments(func)):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


class Trace:
    """The recorded init of the ``PreTrainedModel`` subtrees of a model.

    Args:
        root: the model.
        entries: its entries (:func:`metamat.models.modules.find_entries`).
    """

    def __init__(self, root: nn.Module, entries: Sequence[Any]) -> None:
        self.calls: List[Tuple[Callable, nn.Module, str, str]] = []  # fn, module, name, owner
        self.warnings: List[str] = []
        self.slots: Dict[SlotKey, Tuple[nn.Module, str, bool, torch.Tensor]] = {}
        self.subtree: Dict[int, List[SlotKey]] = {}  # id(module) -> its subtree's slots
        self.ops: Dict[SlotKey, List[_Op]] = {}
        self.entry_of: Dict[SlotKey, Any] = {}
        self.tied: Set[str] = set()
        self.fqn_of: Dict[SlotKey, str] = {}
        self._seq = 0
        self._call = -1
        self._by_storage: Dict[int, SlotKey] = {}
        for e in entries:
            for s in e.slots:
                self.entry_of[(id(s.module), s.name)] = e
        self.roots = [(n, m) for n, m in upstream.pretrained_roots(root)
                      if upstream.init_weights_of(m) is not None]
        for name, m in self.roots:
            pre = f"{name}." if name else ""
            self.tied |= {pre + k for k in upstream.tied_targets(m)}
            self._collect(m, pre)
            self._plan_calls(m, upstream.init_weights_of(m), name, type(m).__name__, set())

    # -- the modules, their slots and the walk ------------------------------------------------

    def _collect(self, m: nn.Module, pre: str) -> None:
        for mname, sub in m.named_modules():
            keys: List[SlotKey] = []
            for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                for k, t in table.items():
                    if t is None:
                        continue
                    key = (id(sub), k)
                    keys.append(key)
                    if key in self.slots:
                        continue
                    e = self.entry_of.get(key)
                    shape = tuple(e.global_shape) if e is not None else tuple(t.shape)
                    proxy = torch.empty(shape, dtype=t.dtype, device="meta")
                    if is_param:
                        proxy = nn.Parameter(proxy, requires_grad=False)
                    self.slots[key] = (sub, k, is_param, proxy)
                    self.fqn_of[key] = pre + (f"{mname}.{k}" if mname else k)
        for _mname, sub in m.named_modules():  # each module's subtree (swapped around a call)
            self.subtree[id(sub)] = [(id(x), k) for x in sub.modules()
                                     for k, t in list(x._parameters.items())
                                     + list(x._buffers.items()) if t is not None]

    def _plan_calls(self, m: nn.Module, fn: Callable, name: str, owner: str,
                    seen: Set[int]) -> None:
        """transformers' ``smart_apply``: children first (a sub-model with its own
        ``_init_weights``), then the module; a module reached twice is initialised once."""
        if id(m) in seen:
            return
        for cname, child in m.named_children():
            cfn = upstream.init_weights_of(child)
            self._plan_calls(child, cfn or fn, f"{name}.{cname}" if name else cname,
                             type(child).__name__ if cfn else owner, seen)
        if id(m) not in seen:
            seen.add(id(m))
            self.calls.append((fn, m, name, owner))

    @contextlib.contextmanager
    def _installed(self, modules: Sequence[nn.Module], real: Optional[Dict[SlotKey, Any]] = None):
        """The proxies (or ``real`` tensors for some slots) in place of the tensors of
        ``modules``' subtrees; everything put back after."""
        saved = []
        try:
            for top in modules:
                for key in self.subtree[id(top)]:
                    sub, k, is_param, proxy = self.slots[key]
                    table = sub._parameters if is_param else sub._buffers
                    saved.append((table, k, table[k]))
                    table[k] = real[key] if real is not None and key in real else proxy
            yield
        finally:
            for table, k, old in reversed(saved):
                table[k] = old

    # -- tracing ---------------------------------------------------------------------------

    def _slot_of(self, t: Any) -> Optional[SlotKey]:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return None
        return self._by_storage.get(storage_key(t))

    def _record(self, key: SlotKey, fn: str, view: Optional[torch.Tensor],
                args: Dict[str, Any]) -> None:
        proxy = self.slots[key][3]
        full = row = None
        dist = None
        if view is not None:
            n = proxy.numel()
            full = view.storage_offset() == 0 and view.numel() == n and view.is_contiguous()
            if not full and proxy.dim() == 2 and proxy.shape[1] > 0:
                cols = proxy.shape[1]
                if view.numel() == cols and view.is_contiguous() and \
                        view.storage_offset() % cols == 0:
                    row = view.storage_offset() // cols
            dist = _dist_of(fn, args, view)
        self.ops.setdefault(key, []).append(_Op(self._seq, self._call, fn, bool(full), row, dist))
        self._seq += 1

    def _recorder(self, name: str, original: Callable) -> Callable:
        sig = inspect.signature(original) if name != "copy_" else None

        def rec(tensor, *args, **kwargs):
            key = self._slot_of(tensor)
            if key is None:
                return original(tensor, *args, **kwargs)
            bound: Dict[str, Any] = {}
            if sig is not None:
                try:
                    b = sig.bind(tensor, *args, **kwargs)
                    b.apply_defaults()
                    bound = dict(b.arguments)
                    bound.pop(next(iter(sig.parameters)))
                except TypeError:
                    bound = {"generator": "unknown call"}
            self._record(key, name, tensor, bound)
            return tensor
        return rec

    @contextlib.contextmanager
    def _recording(self):
        TorchDispatchMode = torch_upstream.dispatch_mode_class()

        mod, names = upstream.init_functions()
        patched: List[Tuple[Any, str, Any]] = []
        originals = {n: getattr(torch.nn.init, n) for n in names if hasattr(torch.nn.init, n)}
        if mod is not None and "copy_" in names:
            originals["copy_"] = mod.copy_
        recs = {n: self._recorder(n, f) for n, f in originals.items()}
        targets = [mod] if mod is not None else []
        targets += [sys.modules[m] for m in upstream.torch_modules_to_patch() if m in sys.modules]
        trace = self

        class _Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                for t in _written(func, args, kwargs):
                    key = trace._slot_of(t)
                    if key is not None:
                        trace._record(key, "write", None, {})
                return func(*args, **kwargs)

        _TRACING.acquire()
        try:
            for target in targets:
                for n, r in recs.items():
                    if callable(getattr(target, n, None)):
                        patched.append((target, n, getattr(target, n)))
                        setattr(target, n, r)
            with _Watch():
                yield
        finally:
            for target, n, f in reversed(patched):
                setattr(target, n, f)
            _TRACING.release()

    def run_trace(self) -> None:
        self._by_storage = {storage_key(p): key for key, (_m, _k, _ip, p) in self.slots.items()}
        with torch.no_grad(), self._installed([m for _n, m in self.roots]), self._recording():
            for ci, (fn, m, name, owner) in enumerate(self.calls):
                self._call = ci
                try:
                    fn(m)
                except Exception as ex:  # noqa: BLE001 - its own tensors are run at fill time
                    for k, t in list(m._parameters.items()) + list(m._buffers.items()):
                        if t is not None:
                            self._record((id(m), k), "write", None, {})
                    self.warnings.append(
                        f"{owner}._init_weights({name or '<root>'}) failed on the meta model "
                        f"({type(ex).__name__}: {ex}); its tensors are initialised by running "
                        "it on real tensors")
                # a tensor reassigned or moved off meta: its writes were not seen
                for key in self.subtree[id(m)]:
                    sub, k, is_param, proxy = self.slots[key]
                    now = (sub._parameters if is_param else sub._buffers).get(k)
                    if now is not proxy or proxy.device.type != "meta":
                        self._record(key, "write", None, {})
                        (sub._parameters if is_param else sub._buffers)[k] = proxy

    # -- decisions --------------------------------------------------------------------------

    def decide(self, e: Any) -> Optional[ModelInit]:
        """How the model's own init sets entry ``e`` (None: no ``_init_weights`` writes it)."""
        keys = [(id(s.module), s.name) for s in e.slots if (id(s.module), s.name) in self.slots]
        own = [k for k in keys if self.fqn_of.get(k) not in self.tied] or keys
        ops = sorted((op for k in own for op in self.ops.get(k, ())), key=lambda o: o.seq)
        if not ops:
            return None
        fulls = [i for i, op in enumerate(ops) if op.full]
        start = fulls[-1] if fulls else 0
        tail = ops[start:]
        head = tail[0]
        owner = self.calls[head.call][3]
        if fulls and head.dist is not None and all(
                op.row is not None and _is_zero(op) and op.row == tail[1].row
                for op in tail[1:]):
            zero_row = tail[1].row if len(tail) > 1 else None
            how = f"{owner}._init_weights: {head.dist}"
            if zero_row is not None:
                how += f", row {zero_row} zeroed"
            return ModelInit(head.dist, zero_row, sorted({op.call for op in tail}), how=how)
        calls = sorted({op.call for op in tail})
        what = sorted({op.fn for op in tail})
        return ModelInit(None, None, calls,
                         how=f"{owner}._init_weights run on the whole tensor ({', '.join(what)})")

    def run(self, e: Any, mi: ModelInit, seed: int) -> torch.Tensor:
        """The global value of ``e`` by running ``mi.calls`` on a real CPU tensor.

        Raises:
            MissingValueError: the calls left (part of) it unset, or raised.
        """
        temp = torch.empty(tuple(e.global_shape), dtype=e.dtype, device="cpu")
        if temp.is_floating_point():
            temp.fill_(float("nan"))
        real: Dict[SlotKey, Any] = {}
        for s in e.slots:
            real[(id(s.module), s.name)] = (nn.Parameter(temp, requires_grad=False)
                                            if s.is_param else temp)
        mods = [self.calls[c][1] for c in mi.calls]
        try:
            with torch.no_grad(), seeded(module_seed(seed, e.fqn)), self._installed(mods, real):
                for c in mi.calls:
                    fn, m, _name, _owner = self.calls[c]
                    fn(m)
        except Exception as ex:  # noqa: BLE001 - named below
            raise MissingValueError(
                f"{e.fqn!r}: the model's own init failed on it ({type(ex).__name__}: {ex}). "
                "Give it a value with init={name: ...} or load it from a checkpoint.",
                names=[e.fqn]) from ex
        if temp.is_floating_point() and bool(torch.isnan(temp).any()):
            raise MissingValueError(
                f"{e.fqn!r}: the model's own init leaves (part of) it unset. Give it a value "
                "with init={name: ...} or load it from a checkpoint.", names=[e.fqn])
        return temp


def trace(root: nn.Module, entries: Sequence[Any]) -> Optional[Trace]:
    """Trace the init of ``root``'s ``PreTrainedModel`` subtrees (None without any)."""
    if upstream.pretrained_class() is None:
        return None
    t = Trace(root, entries)
    if not t.roots:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch's "Initializing zero-element tensors"
        t.run_trace()
    return t
