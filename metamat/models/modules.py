"""Adapter for ordinary modules: plain and DTensor (TP, FSDP2) parameters and buffers.

*Find*: every tensor object registered as a parameter or buffer of a module outside the
TorchRec sharded modules becomes one :class:`Entry` (tied parameters are one object under
several names), with the block of it this rank holds (from the DTensor's mesh and placements)
as targets: 2-D row blocks of the ``(rows, cols)`` view for N-D tensors.

*Values* (:mod:`.module_values`): decides, fills and reports where each meta tensor's value
comes from. *Register* (:mod:`.module_register`): swaps the real tensors in.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..blocks import row_blocks, view_shape
from ..errors import UnsupportedDTensorError
from ..plan import StorageGroup, Target, storage_key
from . import torch_upstream

__all__ = ["Slot", "Entry", "find_entries", "is_dtensor", "local_of", "has_dtensor",
           "entry_targets"]


def is_dtensor(t: Any) -> bool:
    """True if ``t`` is a ``torch.distributed.tensor.DTensor``."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return False  # asked ~7 times per tensor: skip the import and the metaclass check
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor, else ``t``."""
    return torch_upstream.local_tensor(t) if is_dtensor(t) else t


def has_dtensor(model: nn.Module) -> bool:
    """True if any parameter or buffer of ``model`` is a DTensor (TP, FSDP2, ...)."""
    return any(is_dtensor(t) for m in model.modules()
               for t in list(m._parameters.values()) + list(m._buffers.values()))


@dataclass
class Slot:
    """One registration of a tensor: ``module.<name>`` known as ``fqn``."""

    module: nn.Module
    name: str
    fqn: str
    is_param: bool


@dataclass
class Entry:
    """One tensor object (a parameter, possibly tied, or a buffer) and its plan.

    Attributes:
        fqn: canonical name (first in ``named_modules`` order): checkpoint key and RNG key.
        slots: every place it is registered.
        old: the registered object (Parameter, DTensor or plain tensor).
        meta: it is on the meta device (else it is real and stays unless loaded or moved).
        global_shape, global_stride: of the whole tensor.
        local_shape, offsets: the block this rank holds.
        mesh, placements: the DTensor layout (None for a plain tensor).
        persistent: it is in ``state_dict()`` (non-persistent buffers never load).
        fsdp: the FSDP2 ``FSDPParam`` managing it, if any.
        how: where its value comes from (set by the values stage; see module_values).
        targets: its blocks as loader/engine targets.
        local: the real local tensor once allocated.
        new: the object registered in its slots at the register stage.
    """

    fqn: str
    slots: List[Slot]
    old: torch.Tensor
    meta: bool
    dtype: torch.dtype
    requires_grad: bool
    is_param: bool
    global_shape: Tuple[int, ...]
    global_stride: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    mesh: Any = None
    placements: Optional[tuple] = None
    persistent: bool = True
    fsdp: Any = None
    how: str = ""
    targets: List[Target] = field(default_factory=list, repr=False)
    local: Optional[torch.Tensor] = field(default=None, repr=False)
    new: Any = field(default=None, repr=False)

    @property
    def names(self) -> List[str]:
        return [s.fqn for s in self.slots]

    @property
    def owner(self) -> Slot:
        return self.slots[0]

    @property
    def old_local(self) -> torch.Tensor:
        return local_of(self.old)


def entry_targets(e: Entry, x: torch.Tensor) -> List[Target]:
    """The block of ``e`` held in ``x`` (its local tensor) as loader/engine targets: one for
    0-2-D tensors, 2-D row blocks of the ``(rows, cols)`` view for N-D ones."""
    nd = len(e.global_shape)
    aliases = tuple(e.names[1:])
    if nd <= 2:
        return [Target(e.fqn, e.fqn, e.global_shape, e.offsets, e.local_shape, e.dtype,
                       tensor=x, aliases=aliases, persistent=e.persistent)]
    flat = x.view(-1, e.local_shape[-1]) if x.numel() else x.new_empty(0, e.local_shape[-1])
    out = []
    for b in row_blocks(e.global_shape, e.offsets, e.local_shape):
        r0 = b.elem_offset // b.cols if b.cols else 0
        out.append(Target(e.fqn, e.fqn, view_shape(e.global_shape), (b.row, b.col),
                          (b.rows, b.cols), e.dtype, tensor=flat[r0:r0 + b.rows],
                          aliases=aliases, persistent=e.persistent))
    return out


def named_modules_pruned(root: nn.Module, prune: Callable[[str, nn.Module], bool], *,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Module]]:
    """``root.named_modules(remove_duplicate=...)``, in its order, except that nothing below
    a module for which ``prune(name, module)`` holds is visited (that module still is).
    TorchRec's sharded modules hold ~1 module per table that the adapters skip anyway."""
    seen: Optional[Set[int]] = set() if remove_duplicate else None
    limit = sys.getrecursionlimit()  # where torch's recursive walk gives up (a cycle)
    stack: List[Tuple[str, nn.Module, int]] = [("", root, 0)]
    while stack:
        name, m, depth = stack.pop()
        if seen is not None:
            if id(m) in seen:
                continue
            seen.add(id(m))
        yield name, m
        children = m._modules
        if children and not prune(name, m):
            if depth >= limit:
                raise RecursionError(f"module {name!r} is {depth} modules deep: a cycle?")
            stack.extend(reversed([(f"{name}.{k}" if name else k, c, depth + 1)
                                   for k, c in children.items() if c is not None]))


def _fsdp_params(modules: Iterable[nn.Module]) -> Dict[int, Any]:
    """id(sharded parameter) -> FSDPParam, for every FSDP2 module among ``modules``."""
    return torch_upstream.fsdp_params(modules)


def _layout(fqn: str, t: torch.Tensor):
    """(global shape, stride, local shape, offsets, mesh, placements) of ``t``."""
    if not is_dtensor(t):
        shape = tuple(int(s) for s in t.shape)
        return shape, tuple(t.stride()), shape, tuple(0 for _ in shape), None, None
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, tuple(t.placements)
    for p in placements:
        # _StridedShard (FSDP2 on top of TP on the same dim) subclasses Shard in some
        # versions; its local block is not contiguous in the global tensor.
        if torch_upstream.is_strided_shard(p):
            raise UnsupportedDTensorError(
                f"{fqn!r}: placement {p} (FSDP2 + TP sharding the same dim) is not supported; "
                "its local shard is not one block of the global tensor")
        if not isinstance(p, (Shard, Replicate)):
            raise UnsupportedDTensorError(
                f"{fqn!r}: placement {p} is not supported (Shard(dim) and Replicate are)")
    if mesh.get_coordinate() is None:
        raise UnsupportedDTensorError(f"{fqn!r}: this rank is not part of its device mesh")
    shape = tuple(int(s) for s in t.shape)
    local_shape, offsets = torch_upstream.local_shape_and_offset(shape, mesh, placements)
    local_shape, offsets = tuple(map(int, local_shape)), tuple(map(int, offsets))
    have = tuple(int(s) for s in torch_upstream.local_tensor(t).shape)
    if have != local_shape:
        raise UnsupportedDTensorError(
            f"{fqn!r}: local tensor shape {have} differs from the shard shape {local_shape} of "
            f"global {shape} under {placements}")
    return shape, tuple(t.stride()), local_shape, offsets, mesh, placements


def find_entries(root: nn.Module, skip: Sequence[str] = (),
                 keep: Sequence[str] = ()) -> List[Entry]:
    """Every parameter/buffer object of ``root``'s modules, outside the ``skip`` subtrees
    (except the ``keep`` subtrees within them).

    Args:
        root: the module to walk (a DMP's wrapped module for TorchRec models).
        skip: module names whose subtrees another adapter owns (TorchRec sharded modules).
        keep: module names inside ``skip`` subtrees that are ordinary modules all the same
            (the managed-collision collection of a quantized TorchRec collection).

    Returns:
        Entries in ``named_modules`` order; tied tensors are one entry with several slots.

    Raises:
        UnsupportedDTensorError: an unsupported placement or a rank outside the mesh.
    """
    torch_upstream.require("module")  # the Module tables read below
    by_id: Dict[int, Entry] = {}
    order: List[Entry] = []
    if "" in skip and not keep:
        return order
    skipped = set(skip)
    if keep:
        def under(n: str, names) -> bool:  # "" (the root) holds every module
            return any(k == "" or n == k or n.startswith(k + ".") for k in names)

        # the ancestors of the kept subtrees, the root included, are walked through
        ways_in = {""} | {k.rsplit(".", i)[0] for k in keep
                          for i in range(1, k.count(".") + 1)}
        modules = [(n, m) for n, m in named_modules_pruned(
            root, lambda n, _m: n in skipped and n not in ways_in, remove_duplicate=False)
            if under(n, keep) or not under(n, skipped)]
    else:
        # the skipped subtrees are not walked (an FSDP module there manages nothing outside)
        modules = [(n, m) for n, m in named_modules_pruned(
            root, lambda n, _m: n in skipped, remove_duplicate=False) if n not in skipped]
    fsdp = _fsdp_params(m for _, m in modules)
    for mname, m in modules:
        prefix = f"{mname}." if mname else ""
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for k, t in table.items():
                if t is None:
                    continue
                fqn = prefix + k
                e = by_id.get(id(t))
                if e is not None:
                    e.slots.append(Slot(m, k, fqn, is_param))
                    continue
                shape, stride, lshape, offs, mesh, pl = _layout(fqn, t)
                e = Entry(fqn, [Slot(m, k, fqn, is_param)], t,
                          local_of(t).device.type == "meta", t.dtype,
                          bool(getattr(t, "requires_grad", False)) if is_param else False,
                          is_param, shape, stride, lshape, offs, mesh, pl,
                          persistent=is_param or k not in m._non_persistent_buffers_set,
                          fsdp=fsdp.get(id(t)))
                by_id[id(t)] = e
                order.append(e)
    return order


def storages_of(entries: Sequence[Entry]) -> List[StorageGroup]:
    """One storage group per meta storage the meta entries view (FSDP2: the padded shard)."""
    out: Dict[int, StorageGroup] = {}
    for e in entries:
        if not e.meta:
            continue
        loc = e.old_local
        k = storage_key(loc)
        g = out.get(k)
        if g is None:
            g = out[k] = StorageGroup(k, loc.untyped_storage().nbytes(), "targets", where=e.fqn)
        g.tensors.append(loc)
        if e.fsdp is not None:  # FSDP's padded shard may extend past the local view
            pad = torch_upstream.fsdp_padded_shard(e.fsdp)
            g.nbytes = max(g.nbytes, pad.untyped_storage().nbytes())
    return list(out.values())


def targets_of(entries: Sequence[Entry], loading: bool) -> List[Target]:
    """Targets of every meta entry, and of the real persistent ones when ``loading`` (those
    load into shadows, or in place)."""
    out: List[Target] = []
    for e in entries:
        if e.meta or (loading and e.persistent):
            e.targets = entry_targets(e, e.old_local)
            out += e.targets
    return out


def claimed_storages(entries: Sequence[Entry]) -> Set[int]:
    """Keys of the meta storages these entries own."""
    return {storage_key(e.old_local) for e in entries if e.meta}
