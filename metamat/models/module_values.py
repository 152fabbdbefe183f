"""Where each tensor of an ordinary module gets its value, and the fills that give it.

A meta tensor that the checkpoint does not provide takes, in this order (:func:`decide`):

1. an ``init=`` entry naming it: a distribution (fused, plan-invariant), a tensor (its global
   value) or a callable (applied to the whole tensor: each rank keeps its block);
2. a value recorded while the model was built (``metamat.shard_on_meta``);
3. inside a Hugging Face ``PreTrainedModel``, the model's own init (its ``_init_weights``, as
   transformers' ``initialize_weights`` walks it: :mod:`metamat.models.hf.init_trace`),
   fused where it is a known distribution, else run on the whole tensor seeded per fqn;
4. the closed-form rule of its module (nn.Linear, convolutions, nn.Embedding, norm layers;
   TorchRec's unsharded tables, position weights and cross networks);
5. its module's own ``reset_parameters()`` / ``_reset_parameters()`` (TorchRec's MCH
   managed-collision modules: their constructor's values; or a Hugging Face
   model's ``_init_weights``), run under a per-module seed before anything is registered, on
   tensors of the *global* shape on the CPU (each rank keeps its block: the same values on
   every plan and device; a plain CPU tensor is written in place, which is the same);
   floating tensors are poisoned with NaN first, so a reset that leaves one unset is caught
   instead of leaving garbage.

Anything else (typically a non-persistent buffer such as a rotary ``inv_freq`` on meta) is a
:class:`~metamat.errors.MissingValueError` raised before anything is allocated: a floating
tensor is never zero-filled silently. Real tensors keep their values (moved to the target
device if needed) unless the checkpoint provides them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..dtypes import FILL_DTYPES
from ..errors import MissingValueError, UnsupportedError
from ..init import fill_many_
from ..keys import module_seed
from ..rng import seeded
from ..rules import (RESET, Default, InitValue, container_init, default_init, fix_zero_row,
                     match_init, reset_method)
from ..spec import Constant, Dist
from .modules import Entry
from .torchrec.meta_factories import recorded_value  # torch only: no torchrec import

__all__ = ["Decision", "decide", "fill_values", "module_seed"]


class Decision:
    """The value source of one entry (``kind`` is what the Report shows, ``detail`` which
    rule; ``run(seed)`` gives the global value of a model init that is not fused)."""

    __slots__ = ("kind", "dist", "zero_row", "value", "fn", "detail", "run")

    def __init__(self, kind: str, dist: Optional[Dist] = None, zero_row: Optional[int] = None,
                 value: Optional[torch.Tensor] = None, fn: Optional[Callable] = None,
                 detail: str = "", run: Optional[Callable[[int], torch.Tensor]] = None) -> None:
        self.kind, self.dist, self.zero_row, self.value, self.fn = kind, dist, zero_row, value, fn
        self.detail, self.run = detail, run

    @property
    def source(self) -> str:
        """``kind``, and which rule when known (the Report's ``sources``)."""
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def _hf_init_weights(root: nn.Module) -> Optional[Callable[[nn.Module], Any]]:
    fn = getattr(root, "_init_weights", None)
    return fn if callable(fn) else None


def _reset_fn(m: nn.Module, root: nn.Module) -> Optional[Callable[[], Any]]:
    fn = reset_method(m)
    if fn is not None:
        return fn
    fn = _library_initial_values(m)
    if fn is not None:
        return fn
    hf = _hf_init_weights(root)
    return functools.partial(hf, m) if hf is not None else None


def _torchrec_tables(root: nn.Module) -> Dict[int, Tuple[str, Any]]:
    import sys

    if "torchrec" not in sys.modules:
        return {}
    from .torchrec.unsharded import unsharded_tables

    return unsharded_tables(root)


def _torchrec_table(e: Entry, table: str, cfg: Any) -> Decision:
    """An unsharded TorchRec table: its config's init, keyed by the table's name (the values
    of the same table sharded on any plan)."""
    from ..rules import default_table_dist, dist_from_init_fn

    for t in e.targets:
        t.key = table
    if cfg.init_fn is None:
        dist = default_table_dist(cfg.num_embeddings)
        return Decision("rule", dist=dist, detail=f"TorchRec table {table!r} default: {dist}")
    dist = dist_from_init_fn(cfg.init_fn)
    if dist is not None and e.dtype in FILL_DTYPES:
        return Decision("rule", dist=dist, detail=f"TorchRec table {table!r} init_fn: {dist}")
    return Decision("rule", fn=cfg.init_fn, detail=f"TorchRec table {table!r} init_fn "
                    f"{cfg.init_fn!r} on the whole tensor")


def _library_initial_values(m: nn.Module) -> Optional[Callable[[], Any]]:
    """The initial values of a library module without a reset method that its constructor
    computes (TorchRec's unsharded MCHManagedCollisionModule), as a reset; else None."""
    import sys

    if "torchrec" not in sys.modules:
        return None
    from .torchrec.managed_collision import unsharded_initial_values

    return unsharded_initial_values(m)


def _parent_rule(e: Entry, root: nn.Module) -> Optional[Default]:
    """The rule of the module holding ``e``'s ParameterDict/ParameterList, where one names
    that container (TorchRec's PositionWeightedModuleCollection keeps its weights in
    ``position_weights``); others have no rule (a Linear's rule does not cover its extra
    ParameterDict)."""
    path = e.owner.fqn.split(".")[:-1]  # the container's module path
    if not path:
        return None
    try:
        parent = root.get_submodule(".".join(path[:-1]))
    except AttributeError:
        return None
    return container_init(parent, path[-1], e.owner.name, e.global_shape)


def _from_init(e: Entry, v: InitValue) -> Decision:
    if isinstance(v, Dist):
        if e.dtype not in FILL_DTYPES and not isinstance(v, Constant):
            raise UnsupportedError(f"{e.fqn!r}: init= {type(v).__name__} needs a floating "
                                   f"dtype, the tensor is {e.dtype}")
        return Decision("init= distribution", dist=v, detail=str(v))
    if isinstance(v, torch.Tensor):
        if tuple(v.shape) != tuple(e.global_shape):
            raise UnsupportedError(f"{e.fqn!r}: init= tensor has shape {tuple(v.shape)}, the "
                                   f"tensor's global shape is {tuple(e.global_shape)}")
        if v.device.type == "meta":
            raise UnsupportedError(f"{e.fqn!r}: init= tensor is on the meta device")
        return Decision("init= tensor", value=v)
    return Decision("init= callable", fn=v)


def _from_model_init(e: Entry, mi, tr) -> Decision:
    if mi.dist is not None and (e.dtype in FILL_DTYPES or isinstance(mi.dist, Constant)):
        return Decision("model init", dist=mi.dist, zero_row=mi.zero_row, detail=mi.how)
    return Decision("model init (run)", detail=mi.how,
                    run=functools.partial(tr.run, e, mi))


def decide(entries: Sequence[Entry], init: Mapping[str, InitValue], loaded: Set[int],
           root: nn.Module, device: torch.device, warn: Optional[List[str]] = None
           ) -> Tuple[Dict[int, Decision], List[Tuple[str, nn.Module, Callable]]]:
    """Decide every entry's value source (see the module docstring).

    Args:
        entries: from :func:`metamat.models.modules.find_entries`.
        init: the validated ``init=`` mapping.
        loaded: ids of the entries the checkpoint provides.
        root: the model (its ``PreTrainedModel`` subtrees are initialised as transformers
            does: :mod:`metamat.models.hf.init_trace`).
        device: the target device (real tensors elsewhere are moved).
        warn: messages for the Report are appended here.

    Returns:
        (id(entry) -> Decision, the module resets to run: [(module fqn, module, reset fn)]).

    Raises:
        MissingValueError: naming every meta tensor without a value source.
        UnsupportedError: an ``init=`` value that does not fit its tensor.
    """
    out: Dict[int, Decision] = {}
    resets: Dict[int, Tuple[str, nn.Module, Callable]] = {}
    missing: List[str] = []
    traced = False
    tr = None
    tables = None  # unsharded TorchRec tables, found when a tensor first needs a rule
    for e in entries:
        if id(e) in loaded:
            out[id(e)] = Decision("checkpoint")
            continue
        if not e.meta:
            moved = e.mesh is None and e.old.device != device
            out[id(e)] = Decision(f"moved to {device}" if moved else "kept (real)")
            continue
        v = match_init(init, e.names)
        if v is not None:
            out[id(e)] = _from_init(e, v)
            continue
        rec = recorded_value(e.old_local)
        if rec is not None:
            out[id(e)] = Decision("recorded", value=rec)
            continue
        if not traced:  # once, and only when some tensor needs a value
            from .hf.init_trace import trace

            tr, traced = trace(root, entries), True
            if tr is not None and warn is not None:
                warn += tr.warnings
        mi = tr.decide(e) if tr is not None else None
        if mi is not None:
            out[id(e)] = _from_model_init(e, mi, tr)
            continue
        m, attr = e.owner.module, e.owner.name
        if tables is None:
            tables = _torchrec_tables(root)
        if attr == "weight" and id(m) in tables:
            out[id(e)] = _torchrec_table(e, *tables[id(m)])
            continue
        d: Optional[Default] = default_init(m, attr, e.global_shape)
        rule_of = f"{type(m).__name__}.reset_parameters"
        if d is None and isinstance(m, (nn.ParameterDict, nn.ParameterList)):
            d, rule_of = _parent_rule(e, root), "its parent's init"
        if d is not None and d.uncovered:  # its module's own reset would leave it unset
            missing.append(e.fqn)
            continue
        if d is not None and d.dist is not None:
            if e.dtype not in FILL_DTYPES and not isinstance(d.dist, Constant):
                d = RESET
            else:
                out[id(e)] = Decision("rule", dist=d.dist, zero_row=d.zero_row,
                                      detail=f"{rule_of}: {d.dist}"
                                      + (f", row {d.zero_row} zeroed"
                                         if d.zero_row is not None else ""))
                continue
        fn = _reset_fn(m, root)
        if fn is None:
            missing.append(e.fqn)
            continue
        mname = e.owner.fqn.rsplit(".", 1)[0] if "." in e.owner.fqn else ""
        resets.setdefault(id(m), (mname, m, fn))
        out[id(e)] = Decision("reset", detail=f"{type(m).__name__}."
                              f"{getattr(fn, '__name__', 'reset')}() on the whole tensor, "
                              f"seeded by module {mname or '<root>'!r}")
    if missing:
        raise MissingValueError(
            f"{len(missing)} meta tensor(s) have no value: {', '.join(map(repr, missing[:20]))}"
            + (" ..." if len(missing) > 20 else "")
            + ". They are not in the checkpoint, and neither a known init nor their module's "
            "reset_parameters() sets them. Build the model with metamat.init_empty_weights() "
            "(buffers stay real), or give each a value with init={name: tensor | distribution "
            "| callable}.", names=missing)
    return out, list(resets.values())


def _swapped_in(m: nn.Module, new_of: Dict[int, Any]):
    """Context: ``m``'s own tensors replaced by their new objects (clones for real ones that
    are not being replaced, so a reset cannot touch the live model)."""
    class _Ctx:
        def __enter__(self):
            self.p, self.b = dict(m._parameters), dict(m._buffers)
            for table, is_param in ((m._parameters, True), (m._buffers, False)):
                for k, t in list(table.items()):
                    if t is None:
                        continue
                    new = new_of.get(id(t))
                    if new is None:
                        c = t.detach().clone()
                        new = nn.Parameter(c, t.requires_grad) if is_param else c
                    table[k] = new
            return self

        def __exit__(self, *exc):
            m._parameters.clear()
            m._parameters.update(self.p)
            m._buffers.clear()
            m._buffers.update(self.b)
            return False
    return _Ctx()


def _whole(e: Entry) -> bool:
    """A reset or callable writes ``e`` through a CPU tensor of its global shape (a sharded
    or non-CPU tensor), not in place: the values then depend on nothing but the seed."""
    return e.mesh is not None or e.local.device.type != "cpu"


def _block(e: Entry, full: torch.Tensor) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(e.offsets, e.local_shape))]


def _run_resets(entries: Sequence[Entry], dec: Dict[int, Decision],
                resets: Sequence[Tuple[str, nn.Module, Callable]], seed: int) -> None:
    new_of = {id(e.old): e.new for e in entries if e.new is not None}
    by_module: Dict[int, List[Entry]] = {}
    in_module: Dict[int, List[Entry]] = {}
    for e in entries:
        if dec[id(e)].kind == "reset":
            by_module.setdefault(id(e.owner.module), []).append(e)
        if e.meta:
            for s in e.slots:
                in_module.setdefault(id(s.module), []).append(e)
    unset: List[str] = []
    with torch.no_grad():
        for mname, m, fn in resets:
            mine = by_module.get(id(m), [])
            # every meta tensor of m, its global shape on the CPU (kept only for m's reset
            # entries): the reset draws the same numbers whatever the plan or device
            whole: Dict[int, torch.Tensor] = {}
            swap = dict(new_of)
            for e in in_module.get(id(m), []):
                if _whole(e) and id(e.old) not in whole:
                    w = torch.empty(e.global_shape, dtype=e.dtype, device="cpu")
                    whole[id(e.old)] = w
                    swap[id(e.old)] = nn.Parameter(w, e.requires_grad) if e.is_param else w
            for e in mine:
                x = whole.get(id(e.old), e.local)
                if x.is_floating_point():
                    x.fill_(float("nan"))
            with seeded(module_seed(seed, mname), [e.local.device for e in mine]), \
                    _swapped_in(m, swap):
                fn()
            for e in mine:
                x = whole.get(id(e.old), e.local)
                if x.is_floating_point() and bool(torch.isnan(x).any()):
                    unset.append(f"{e.fqn} ({type(m).__name__})")
                elif x is not e.local:
                    e.local.copy_(_block(e, x))
    if unset:
        raise MissingValueError(
            "reset_parameters() left these meta tensors (partly) unset: " + ", ".join(unset[:20])
            + ". Give them a value with init={name: ...}, or load them from a checkpoint.",
            names=[u.split(" ")[0] for u in unset])


def fill_values(entries: Sequence[Entry], dec: Dict[int, Decision],
                resets: Sequence[Tuple[str, nn.Module, Callable]], seed: int) -> int:
    """Write every meta entry the checkpoint does not provide (resets first, then fused
    distributions, values and callables, which therefore win). Returns bytes written.

    Raises:
        MissingValueError: a reset left a tensor unset.
    """
    _run_resets(entries, dec, resets, seed)
    items, consts, written = [], [], 0
    with torch.no_grad():
        for e in entries:
            d = dec[id(e)]
            if not e.meta or d.kind in ("checkpoint", "reset") or e.local.numel() == 0:
                continue
            written += e.local.numel() * e.local.element_size()
            if d.dist is not None:
                if e.dtype not in FILL_DTYPES:
                    consts.append((e, d))
                    continue
                for t in e.targets:
                    x = t.tensor.view(1) if t.tensor.dim() == 0 else t.tensor
                    off = tuple(t.offsets) + (0, 0)
                    items.append((x, d.dist, t.key, int(off[0]), int(off[1])))
            elif d.value is not None:
                e.local.copy_(_block(e, d.value))
            elif d.run is not None:
                e.local.copy_(_block(e, d.run(seed)))
            elif d.fn is not None:
                with seeded(module_seed(seed, e.fqn), [e.local.device]):
                    if _whole(e):
                        full = torch.empty(e.global_shape, dtype=e.dtype, device="cpu")
                        d.fn(full)
                        e.local.copy_(_block(e, full))
                    else:
                        d.fn(e.local)
        fill_many_(items, seed=seed)
        for e, d in consts:
            e.local.fill_(d.dist.value)
        for e in entries:
            d = dec[id(e)]
            if e.meta and d.zero_row is not None and d.dist is not None:
                fix_zero_row(e.local, d.zero_row, e.offsets[0] if e.offsets else 0)
    return written
