"""Rebuild a meta DMP's embedding collections for fbgemm's CUDA layout.

``DistributedModelParallel(module, device=torch.device("meta"), init_parameters=False)`` (or
``shard_on_meta`` without a compute device) gets fbgemm's CPU layout: TorchRec chooses the CPU
kernels for any device that is not a GPU. Only fbgemm's constructors lay tables out for a GPU
(device and UVM buffers, LXU caches), so materializing such a model on a GPU means building its
kernels again. While every table is on meta nothing is lost by that: each sharded
EmbeddingBagCollection / EmbeddingCollection is sharded again from its table configs, with the
DMP's plan, sharder and process group, the way ``shard_on_meta(compute_device="cuda")`` builds
it (on meta), and put in its place; the DMP's combined optimizer is rebuilt over the new
modules. :func:`relayout_for_cuda` returns an undo that puts everything back, so a failed
``materialize`` leaves the model as it was.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch
from torch import nn

from .compat import UnsupportedError

__all__ = ["relayout_for_cuda"]

_META = torch.device("meta")


def _tables_meta(sm: nn.Module) -> bool:
    """Every fused table of ``sm`` is on meta. (Dense data-parallel tables may be real: DMP on
    meta builds them for real with torch's RNG on a GPU host; they are built again on meta.)"""
    from .sharded import wrappers
    from .upstream import kernel_module

    for w in wrappers(sm):
        emb = kernel_module(w)
        if type(emb).__name__ != "SplitTableBatchedEmbeddingBagsCodegen":
            continue
        for t in list(emb.parameters()) + list(emb.buffers()):
            if t.is_floating_point() and t.numel() and not t.is_meta:
                return False
    return True


def _unsharded(sm: nn.Module) -> nn.Module:
    """An unsharded collection on meta with ``sm``'s tables."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from . import upstream

    if type(sm) is ShardedEmbeddingBagCollection:
        return EmbeddingBagCollection(tables=upstream.table_configs(sm),
                                      is_weighted=upstream.is_weighted(sm), device=_META)
    if type(sm) is ShardedEmbeddingCollection:
        return EmbeddingCollection(tables=upstream.table_configs(sm), device=_META,
                                   need_indices=upstream.need_indices(sm))
    raise UnsupportedError(f"{type(sm).__name__}: cannot be laid out for a GPU again")


def _parent(model: nn.Module, root: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """(object, attribute) holding the module at ``path`` (the DMP itself for the root)."""
    if not path:
        from .upstream import WRAPPED

        return model, WRAPPED
    *up, leaf = path.split(".")
    parent = root
    for name in up:
        parent = getattr(parent, name)
    return parent, leaf


def relayout_for_cuda(model: nn.Module, sharded: List[Tuple[str, nn.Module]],
                      device: torch.device) -> Callable[[], None]:
    """Shard ``model``'s collections ``sharded`` (``(path, module)`` under the DMP's wrapped
    module) again for fbgemm's CUDA layout on ``device``, on meta. Returns the undo.

    Raises:
        UnsupportedError: not a TorchRec DMP, a table that already holds values, a collection
            type or plan this cannot rebuild (nothing was changed then).
    """
    from . import upstream
    from .managed_collision import mc_collections
    from .meta_plan import plan_to_meta
    from .shard import this_ranks_gpu, building_on_meta
    from .sharded import root_of

    mcs = mc_collections(root_of(model))
    if mcs:  # its container keeps the old TBEs (eviction resets their rows): not rebuilt here
        raise UnsupportedError(
            f"{mcs[0][0] or '<root>'}: a managed-collision collection laid out for the CPU "
            "cannot be laid out again for a GPU; shard it with metamat.shard_on_meta(..., "
            "compute_device='cuda')")

    if not upstream.is_dmp(model):
        raise UnsupportedError(
            f"{type(model).__name__}: TorchRec tables laid out for fbgemm's CPU kernels can be "
            "laid out for a GPU again only in a DistributedModelParallel; shard with "
            "metamat.shard_on_meta(..., compute_device='cuda') (or shard_modules_on_meta(..., "
            "compute_device='cuda'))")
    upstream.require("train")
    upstream.check_dmp(model)  # the DMP internals used below (UnsupportedError naming them)
    upstream.check_sharded(sharded)
    root = root_of(model)
    rebuilt = []
    for path, sm in sharded:
        where = path or "<root>"
        if not _tables_meta(sm):
            raise UnsupportedError(
                f"{where}: its tables were built for fbgemm's CPU kernels and hold values: "
                "they cannot move to a GPU (materialize with device='cpu', or build the model "
                "on meta)")
        if not path and upstream.dmp_wrapped(model) is not sm:
            raise UnsupportedError(f"{where}: the DMP wraps its table collection in "
                                   f"{type(upstream.dmp_wrapped(model)).__name__}; shard with "
                                   "metamat.shard_on_meta(..., compute_device='cuda')")
        unsharded = _unsharded(sm)
        sharder = upstream.dmp_sharder_map(model).get(type(unsharded))
        params = upstream.dmp_plan(model).get_plan_for_module(path)
        if sharder is None or not params:
            raise UnsupportedError(f"{where}: no sharder or plan for {type(unsharded).__name__}")
        rebuilt.append((path, sm, unsharded, sharder, params))
    gpu = this_ranks_gpu(device) if device.type == "cuda" else torch.device("cuda")
    from torchrec.distributed.types import ShardingPlan

    from .cuda_kernels import check_cuda_plan

    plan = ShardingPlan({p: params for p, _, _, _, params in rebuilt})
    check_cuda_plan(plan)
    rank_devices: dict = {}
    plan = plan_to_meta(plan, rank_devices)
    swaps = []
    with building_on_meta(gpu) as records:
        for path, old, unsharded, sharder, _ in rebuilt:
            new = sharder.shard(unsharded, plan.plan[path], upstream.dmp_env(model), _META,
                                path)
            swaps.append((*_parent(model, root, path), old, new))
    old_optim = upstream.dmp_optim(model)
    saved = {k: model.__dict__.get(k) for k in
             ("_metamat_compute_device", "_metamat_cuda_tbes", "_metamat_rank_devices")}
    for parent, leaf, _old, new in swaps:
        setattr(parent, leaf, new)
    try:
        upstream.set_dmp_optim(model, upstream.dmp_init_optim(model, upstream.dmp_wrapped(model)))
    except BaseException:
        for parent, leaf, old, _new in swaps:
            setattr(parent, leaf, old)
        raise
    model._metamat_compute_device = gpu
    model._metamat_cuda_tbes = records
    model._metamat_rank_devices = rank_devices

    def undo() -> None:
        for parent, leaf, old, _new in swaps:
            setattr(parent, leaf, old)
        upstream.set_dmp_optim(model, old_optim)
        for k, v in saved.items():
            if v is None:
                model.__dict__.pop(k, None)
            else:
                model.__dict__[k] = v
    return undo
