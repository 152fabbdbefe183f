"""Check shard placements against a process group's ranks in constant time while TorchRec's
ShardedTensors are built.

Every ShardedTensor constructor validates every shard's placement with torch's
``_parse_and_validate_remote_device``, which builds the list of all the group's ranks
(``get_process_group_ranks``) and scans it: O(world size) per shard, and a row-wise table's
ShardedTensor has a shard per rank, so O(world size²) per tensor, five tensors per table.
Measured with 20 row-wise tables in one process on a fake process group (AMD EPYC Zen 4):
``shard_on_meta`` took 0.21 s at 256 ranks, 1.3 s at 1,024, 2.8 s at 2,048, 8.0 s at 4,096.
Eager DMP pays it too.

``indexed_group_ranks()`` makes torch's modules call, while it is active, the same check with
each group's ranks kept as a set, built once per group: the same results and the same errors
(anything but a plain rank placement that passes, a worker name or a rank outside the group,
goes to torch's own function). On exit torch's function is back.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Dict, Iterator, Tuple

__all__ = ["indexed_group_ranks"]

from ..torch_upstream import PLACEMENT_CHECK as _NAME
# torch modules that call `_parse_and_validate_remote_device` through their own global name
from ..torch_upstream import PLACEMENT_CHECK_CALLERS as _CALLERS


def _indexed(real: Callable, c10d: Any) -> Callable:
    """``real`` (torch's check) with the group's ranks looked up in a set."""
    from ..torch_upstream import rank_not_in_group

    ranks_of: Dict[int, Tuple[Any, frozenset]] = {}  # id(group) -> (group, its global ranks)

    def parse_and_validate_remote_device(pg: Any, remote_device: Any):
        if remote_device is None or remote_device.worker_name() is not None:
            return real(pg, remote_device)  # an error, or RPC workers: torch's own path
        rank = remote_device.rank()
        if rank is not None and not rank_not_in_group(pg):
            hit = ranks_of.get(id(pg))
            if hit is None or hit[0] is not pg:
                hit = ranks_of[id(pg)] = (pg, frozenset(c10d.get_process_group_ranks(pg)))
            if rank not in hit[1]:
                return real(pg, remote_device)  # raises torch's error
        return rank, remote_device.device()

    return parse_and_validate_remote_device


@contextlib.contextmanager
def indexed_group_ranks() -> Iterator[None]:
    """While active, torch's shard placement check looks ranks up in a set (module
    docstring). The three callers are declared patch sites (:mod:`..torch_upstream`; a missing
    one raises UnsupportedError); a module whose function is not torch's (already patched by
    an outer call, or a torch whose modules differ) is left alone."""
    import torch.distributed.distributed_c10d as c10d

    from .. import torch_upstream as tu

    tu.require("sharded_tensor")
    real = getattr(importlib.import_module(_CALLERS[0]), _NAME)
    fast = _indexed(real, c10d)
    with contextlib.ExitStack() as stack:
        for name in _CALLERS:
            if getattr(importlib.import_module(name), _NAME) is real:
                stack.enter_context(tu.patch(name, _NAME, fast))
        yield
