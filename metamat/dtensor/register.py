"""Register: agree across ranks, then swap the real blocks into the model.

:func:`agree` is the one collective: every rank reports success, and only if all did does any
rank :func:`swap` (which cannot fail on bad input: everything was validated before).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from ..checkpoint.errors import CheckpointError
from .errors import PeerCheckpointError, PeerFailedError
from .walk import Entry

__all__ = ["agree", "swap"]


def agree(error: Optional[BaseException], group=None) -> None:
    """Every rank says whether it succeeded; if any failed, every rank raises (the failing
    rank its own error, the others :class:`PeerFailedError` naming it, a
    :class:`PeerCheckpointError` when it was a checkpoint problem). Without a process group
    only the own error is raised.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else (isinstance(error, CheckpointError),
                                       f"{type(error).__name__}: {error}")
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if failed:
        r, (is_ckpt, msg) = failed[0]
        cls = PeerCheckpointError if is_ckpt else PeerFailedError
        raise cls(f"rank(s) {[r for r, _ in failed]} failed, nothing was registered; "
                  f"rank {r}: {msg}")


def _new_tensor(e: Entry) -> torch.Tensor:
    if e.mesh is None:
        x = e.local
    else:
        from torch.distributed.tensor import DTensor
        x = DTensor.from_local(e.local, e.mesh, e.placements, run_check=False,
                               shape=torch.Size(e.global_shape), stride=e.global_stride)
    if e.is_param:
        return nn.Parameter(x, requires_grad=e.requires_grad)
    return x


def swap(entries: Sequence[Entry]) -> int:
    """Replace each meta tensor by its real one everywhere it is registered (tied parameters
    stay one object) and hand FSDP2 its new sharded parameters.

    Returns:
        Number of tensor objects replaced.
    """
    with torch.no_grad():
        for e in entries:
            new = _new_tensor(e)
            for s in e.slots:
                (s.module._parameters if s.is_param else s.module._buffers)[s.name] = new
            if e.fsdp is not None:
                _adopt_fsdp(e, new)
    return len(entries)


def _adopt_fsdp(e: Entry, new: nn.Parameter) -> None:
    """Point the FSDPParam at the new parameter and its padded storage.

    ``reset_sharded_param`` (what FSDP runs after ``to_empty``/``load_state_dict(assign=True)``)
    re-reads the module's parameter; with ``_sharded_param_data`` already on our padded storage
    it recognises the same memory and copies nothing.
    """
    fp = e.fsdp
    fp._sharded_param_data = e.storage.view(-1)
    fp.sharded_param = new
    fp.reset_sharded_param()
    if fp.sharded_param is not new:  # pragma: no cover - FSDP internals changed
        raise RuntimeError(f"FSDP did not adopt the new parameter for {e.fqn!r}")


