"""``plan_to_meta``: a copy of a TorchRec sharding plan whose shard placements name meta."""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch

__all__ = ["plan_to_meta"]

_META = torch.device("meta")


def plan_to_meta(plan: Any, rank_devices: Optional[Dict[int, torch.device]] = None) -> Any:
    """Return a copy of a ShardingPlan whose shard placements name the meta device (the
    caller's plan is left as it was). ``rank_devices`` receives each rank's device as the
    plan placed it (CUDA placements only), for the placements ``materialize`` restores."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    from ..torch_upstream import remote_device, require, set_placement_device

    require("sharded_tensor")

    # Copy only what changes (the plan objects down to each shard's placement): a deep copy
    # of the whole plan costs ~1 ms per table and leaves the caller's plan as untouched.
    plan = copy.copy(plan)
    plan.plan = dict(plan.plan)
    for path, module_plan in list(plan.plan.items()):
        if not hasattr(module_plan, "items"):
            continue
        module_plan = plan.plan[path] = copy.copy(module_plan)
        for name, ps in list(module_plan.items()):
            ps = module_plan[name] = copy.copy(ps)  # DMP may annotate it: not the caller's
            spec = getattr(ps, "sharding_spec", None)
            if spec is None or not isinstance(spec, EnumerableShardingSpec):
                continue
            spec = ps.sharding_spec = copy.copy(spec)
            spec.shards = [copy.copy(sm) for sm in spec.shards]
            for sm in spec.shards:
                placement = sm.placement
                if isinstance(placement, str):
                    placement = remote_device(placement)
                else:
                    placement = copy.copy(placement)
                if placement is not None:
                    dev = placement.device()
                    if rank_devices is not None and placement.rank() is not None and \
                            dev is not None and dev.type == "cuda":
                        rank_devices.setdefault(placement.rank(), dev)
                    set_placement_device(placement, _META)
                    sm.placement = placement
    return plan
