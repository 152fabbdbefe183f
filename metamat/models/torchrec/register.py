"""Register stage: swap the real tensors in, everywhere the meta ones were referenced.

Every slot the plan's object-graph scan found (module parameter dicts, plain attributes,
lists, optimizer state keys and values, Shard slots, TableBatchedEmbeddingSlice's
``_original_tensor``) now refers to the twin, so TorchRec's aliases (views, local shards,
ShardedTensors, fused optimizer state) all point into the live TBE storage. Then:
meta placements and ``device`` attributes name the real device, DDP wrappers built on meta
are rebuilt, and DMP's deferred dense DDP wrap runs.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict

import torch
from torch.nn.parallel import DistributedDataParallel

from ...allocate import Allocation
from ..torch_upstream import REMOTE_DEVICE_FIELDS
from .walk import TorchRecPlan as Plan

__all__ = ["register"]

_META = torch.device("meta")
_WORKER, _RANK, _DEVICE = REMOTE_DEVICE_FIELDS


def rank_devices(model: Any, plan: Plan, *, me: int, world_size: int):
    """rank -> the device its shards live on, for shard placements (``rank:N/cuda:M``): this
    rank's (``me``) is ``plan.device``; another rank's on a CUDA device is the one that rank
    said it materialized on (``plan.peer_devices``, gathered at the fill agreement), else
    what the sharding plan said (``shard_on_meta`` kept it), else ``cuda:(rank % local world
    size)`` as TorchRec plans it. On the CPU (or the emulated device) every rank's is
    ``plan.device``."""
    device = plan.device
    if device.type != "cuda":
        return lambda rank: device
    from torchrec.distributed.comm import get_local_size

    recorded = getattr(model, "_metamat_rank_devices", None) or {}
    said = {r: torch.device(d) for r, d in plan.peer_devices.items() if d.startswith("cuda:")}
    local = max(1, get_local_size(world_size))

    def of(rank):
        if rank is None or rank == me:
            return device
        return said.get(rank) or recorded.get(rank) or torch.device("cuda", rank % local)
    return of


def _fix_devices(model: Any, plan: Plan, device: torch.device) -> None:
    """Meta devices in attributes (``_remote_device`` placements of shard metadata, modules'
    and TBEs' ``device``) name the real device (a placement: its rank's); the scan listed
    every such attribute."""
    import torch.distributed as dist

    on = dist.is_initialized()
    of_rank = rank_devices(model, plan, me=dist.get_rank() if on else 0,
                           world_size=dist.get_world_size() if on else 1)
    for holder, key in plan.graph.device_refs:
        d = holder.__dict__
        v = d.get(key)
        if isinstance(v, torch.device) and v.type == "meta":
            # a shard placement (torch's _remote_device: its declared fields)
            rank = d.get(_RANK) if key == _DEVICE and _WORKER in d else None
            d[key] = of_rank(rank) if rank is not None else device
        elif isinstance(v, str) and v == "meta" and key in ("device", "_device"):
            d[key] = device


def _rebuild_ddps(plan: Plan) -> None:
    from .shard import MetaDDP

    # decided per type: DDP's metaclass is ABCMeta (Joinable), so isinstance on each of the
    # graph's ~35 objects per table went through ABCMeta.__instancecheck__ (~10 µs per table)
    is_ddp: Dict[type, bool] = {}
    for obj in list(plan.graph.objects.values()):
        cls = type(obj)
        hit = is_ddp.get(cls)
        if hit is None:
            hit = is_ddp[cls] = issubclass(cls, MetaDDP)
        if not hit:
            continue
        kwargs = dict(obj.metamat_kwargs)
        kwargs["init_sync"] = False  # values are identical on all ranks by construction
        # TorchRec gives its lookups' DDPs the device when it is a GPU (None on meta)
        kwargs["device_ids"] = [plan.device] if plan.device.type == "cuda" else None
        new = DistributedDataParallel(obj.module, **kwargs)
        for slot in plan.graph.slots.get(id(obj), []):
            slot.set(new)


def _make_streams(plan: Plan) -> None:
    """The CUDA stream of each FULLY_SHARDED kernel (a placeholder while built on meta), made
    on the GPU its weights now live on (not on the emulated device: no CUDA there)."""
    from . import upstream
    from .sharded import named_wrappers
    from .two_dim import NoStream

    if plan.device.type != "cuda" or plan.emulated:
        return
    for _, w in named_wrappers(plan.sharded):
        if isinstance(upstream.fully_sharded_stream(w), NoStream):
            upstream.set_fully_sharded_stream(w, torch.cuda.Stream(device=plan.device))


def _fix_batch_info(plan: Plan) -> None:
    """The batch-index bits of every fbgemm training TBE, which its constructor on meta left
    at the meta kernel's -1 (upstream.TBE_BATCH_INFO)."""
    from . import upstream
    from .sharded import named_wrappers

    for _, w in named_wrappers(plan.sharded):
        upstream.fix_batch_info(upstream.kernel_module(w))


def _fix_process_groups(plan: Plan) -> None:
    """Create the intra/cross-node groups TWRW and grid sharding skip on meta (under 2D,
    two_dim.py creates them while building), and rebuild the output dists TorchRec built
    with the missing groups (collective: same order on all ranks, since every rank walks the
    same module structure)."""
    import torch.distributed as dist
    from torchrec.distributed.comm import intra_and_cross_node_pg

    from . import upstream

    for _, sm in plan.sharded:
        for i, sh in enumerate(upstream.shardings(sm)):
            groups = upstream.node_groups(sh)  # TWRW and grid shardings have them
            if groups is None or groups[0] is not None:
                continue
            if upstream.is_2d_parallel(sh):  # two_dim.py creates them while building
                raise RuntimeError("metamat: a 2D-parallel TWRW/grid sharding was built "
                                   "without its node groups")
            intra, cross = intra_and_cross_node_pg(
                plan.device, backend=dist.get_backend(upstream.sharding_pg(sh)))
            upstream.set_node_groups(sh, intra, cross)
            dists = upstream.output_dists(sm)
            if i < len(dists):
                dists[i] = sh.create_output_dist(device=plan.device)


def register(model: Any, plan: Plan, alloc: Allocation) -> None:
    """Swap every meta tensor of ``plan`` for its twin, fix devices, rebuild DDPs."""
    twins = alloc.twins()
    retupled: Dict[int, tuple] = {}  # id of a tuple holding meta tensors -> its new tuple
    for old_id, new in twins.items():
        for slot in plan.graph.slots.get(old_id, []):
            holder = slot.holder
            if isinstance(holder, torch.Tensor) and id(holder) in twins:
                continue  # the twin already carries a mapped copy of this attribute
            if slot.kind == "tuple":  # walk checked: a plain tuple in mutable slots
                items = list(retupled.get(id(holder), holder))
                items[slot.key] = new
                retupled[id(holder)] = tuple(items)
                continue
            slot.set(new)
    for tid, new_tuple in retupled.items():
        for slot in plan.graph.slots.get(tid, []):
            slot.set(new_tuple)
    _fix_devices(model, plan, plan.device)
    _fix_batch_info(plan)
    _make_streams(plan)
    _fix_process_groups(plan)
    _rebuild_ddps(plan)
    if getattr(model, "_metamat_defer_ddp", False) and hasattr(model, "init_data_parallel"):
        model._metamat_defer_ddp = False
        with warnings.catch_warnings():
            # TorchRec's dense DDP wrap passes broadcast_buffers=False (no init-time buffer
            # sync, which forward_sync_buffers cannot say): its FutureWarning is TorchRec's,
            # not the caller's to act on; the same call, the same behaviour.
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated",
                                    category=FutureWarning)
            model.init_data_parallel()
