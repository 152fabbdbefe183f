"""Plan: find the meta tensors of a model (DTensors and plain ones), one entry per tensor object.

Each :class:`Entry` records every place the tensor is registered (tied parameters are one
object under several names), its global shape and the block of it this rank holds (from the
DTensor's mesh and placements), how to initialise it, and the FSDP2 parameter managing it.
Planning allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..plan import Target, block_nbytes
from ..spec import Constant, Dist
from .blocks import row_blocks, view_shape
from .errors import UnsupportedDTensorError
from .init import RESET, Default, default_init, match_init

__all__ = ["Slot", "Entry", "walk", "has_dtensor", "is_dtensor", "local_of", "check_init"]

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def is_dtensor(t: Any) -> bool:
    """True if ``t`` is a ``torch.distributed.tensor.DTensor``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor, else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def has_dtensor(model: nn.Module) -> bool:
    """True if any parameter or buffer of ``model`` is a DTensor (TP, FSDP2, ...).

    This is the predicate ``metamat.materialize`` dispatches on.
    """
    if not torch.distributed.is_available():
        return False
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
    """One meta tensor object (a parameter, possibly tied, or a buffer) and its plan.

    Attributes:
        fqn: canonical name (first in ``named_modules`` order): checkpoint key and RNG key.
        slots: every place it is registered.
        old: the meta tensor (Parameter/DTensor) itself.
        global_shape, global_stride: of the whole tensor.
        local_shape, offsets: the block this rank holds.
        mesh, placements: the DTensor layout (None for a plain tensor).
        default: how it is initialised when not loaded (fused dist, or the module's reset).
        persistent: it is in ``state_dict()`` (non-persistent buffers never load).
        fsdp: the FSDP2 ``FSDPParam`` managing it, if any.
        storage, local: allocated memory (FSDP: the padded shard) and the local block view.
    """

    fqn: str
    slots: List[Slot]
    old: torch.Tensor
    dtype: torch.dtype
    requires_grad: bool
    is_param: bool
    global_shape: Tuple[int, ...]
    global_stride: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    mesh: Any = None
    placements: Optional[tuple] = None
    default: Default = RESET
    persistent: bool = True
    fsdp: Any = None
    storage: Optional[torch.Tensor] = field(default=None, repr=False)
    local: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def names(self) -> List[str]:
        return [s.fqn for s in self.slots]

    @property
    def owner(self) -> Slot:
        return self.slots[0]

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.local_shape, self.dtype)

    def targets(self, tensor: Optional[torch.Tensor] = None) -> List[Target]:
        """This entry's block as loader/engine targets (1-D/2-D; N-D cut into 2-D row blocks
        of the ``(rows, cols)`` view), with ``tensor`` (default ``self.local``) viewed to match.
        """
        x = self.local if tensor is None else tensor
        nd = len(self.global_shape)
        dist = self.default.dist
        if nd <= 2:
            return [Target(self.fqn, self.fqn, self.global_shape, self.offsets, self.local_shape,
                           self.dtype, dist, x)]
        flat = None if x is None else x.view(-1, self.local_shape[-1]) \
            if x.numel() else x.new_empty(0, self.local_shape[-1])
        out = []
        for b in row_blocks(self.global_shape, self.offsets, self.local_shape):
            r0 = b.elem_offset // b.cols if b.cols else 0
            t = None if flat is None else flat[r0:r0 + b.rows]
            out.append(Target(self.fqn, self.fqn, view_shape(self.global_shape), (b.row, b.col),
                              (b.rows, b.cols), self.dtype, dist, t))
        return out


def _fsdp_params(model: nn.Module) -> Dict[int, Any]:
    """id(sharded parameter) -> FSDPParam, for every FSDP2 module of ``model``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {}
    out: Dict[int, Any] = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            for fp in group.fsdp_params:
                out[id(fp.sharded_param)] = fp
    return out


def _layout(fqn: str, t: torch.Tensor):
    """(global shape, stride, local shape, offsets, mesh, placements) of ``t``."""
    if not is_dtensor(t):
        shape = tuple(int(s) for s in t.shape)
        return shape, tuple(t.stride()), shape, tuple(0 for _ in shape), None, None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    for p in placements:
        # _StridedShard (FSDP2 on top of TP on the same dim) subclasses Shard in some
        # versions; its local block is not contiguous in the global tensor.
        if type(p).__name__ == "_StridedShard":
            raise UnsupportedDTensorError(
                f"{fqn!r}: placement {p} (FSDP2 + TP sharding the same dim) is not supported; "
                "its local shard is not one block of the global tensor")
        if not isinstance(p, (Shard, Replicate)):
            raise UnsupportedDTensorError(
                f"{fqn!r}: placement {p} is not supported (Shard(dim) and Replicate are)")
    if mesh.get_coordinate() is None:
        raise UnsupportedDTensorError(f"{fqn!r}: this rank is not part of its device mesh")
    shape = tuple(int(s) for s in t.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    local_shape, offsets = tuple(map(int, local_shape)), tuple(map(int, offsets))
    have = tuple(int(s) for s in t._local_tensor.shape)
    if have != local_shape:
        raise UnsupportedDTensorError(
            f"{fqn!r}: local tensor shape {have} differs from the shard shape {local_shape} of "
            f"global {shape} under {placements}")
    return shape, tuple(t.stride()), local_shape, offsets, mesh, placements


def walk(model: nn.Module, init: Optional[Mapping[str, Dist]] = None) -> List[Entry]:
    """Plan every meta tensor of ``model``.

    Args:
        model: a module holding meta DTensors and/or plain meta tensors.
        init: fnmatch pattern -> distribution, matched against every name of a tensor.

    Returns:
        Entries in ``named_modules`` order.

    Raises:
        UnsupportedDTensorError: an unsupported placement, a distribution for a non-float
            tensor, or a parameter with no fused init and no ``reset_parameters()``.
        TypeError: an ``init`` value that is not a distribution.
    """
    by_id: Dict[int, Entry] = {}
    order: List[Entry] = []
    fsdp = _fsdp_params(model)
    for mname, m in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for k, t in table.items():
                if t is None or local_of(t).device.type != "meta":
                    continue
                fqn = prefix + k
                e = by_id.get(id(t))
                if e is not None:
                    e.slots.append(Slot(m, k, fqn, is_param))
                    continue
                shape, stride, lshape, offs, mesh, pl = _layout(fqn, t)
                e = Entry(fqn, [Slot(m, k, fqn, is_param)], t, t.dtype,
                          bool(getattr(t, "requires_grad", False)) if is_param else False,
                          is_param, shape, stride, lshape, offs, mesh, pl,
                          persistent=is_param or k not in m._non_persistent_buffers_set,
                          fsdp=fsdp.get(id(t)))
                by_id[id(t)] = e
                order.append(e)
    for e in order:
        e.default = _decide(e, init)
    return order


def _decide(e: Entry, init: Optional[Mapping[str, Dist]]) -> Default:
    m, attr = e.owner.module, e.owner.name
    dist = match_init(init, e.names)
    if dist is not None:
        d = Default(dist=dist)
    else:
        has_reset = callable(getattr(m, "reset_parameters", None))
        d = default_init(m, attr, e.global_shape, e.is_param, has_reset)
    if d.dist is not None and e.dtype not in _FUSED_DTYPES and not isinstance(d.dist, Constant):
        raise UnsupportedDTensorError(
            f"{e.fqn!r}: {type(d.dist).__name__} needs a floating dtype, tensor is {e.dtype}")
    return d


def check_init(entries) -> None:
    """Raise if an entry that must be initialised has neither a fused distribution nor a
    module ``reset_parameters()`` (called before anything is written).

    Raises:
        UnsupportedDTensorError: naming every such tensor.
    """
    bad = [e for e in entries if e.default.reset
           and not callable(getattr(e.owner.module, "reset_parameters", None))]
    if bad:
        raise UnsupportedDTensorError(
            "no init for " + ", ".join(f"{e.fqn!r} ({type(e.owner.module).__name__} has no "
                                       "reset_parameters())" for e in bad[:20])
            + "; name them in init= to give them a distribution, or load them")
