"""``shard_on_meta``: build a TorchRec ``DistributedModelParallel`` whose tables stay on meta.

TorchRec's DMP, given ``device=meta``, still allocates real memory in three places and
breaks in two more (measured on torchrec 1.8.0):

* the DENSE kernel and DATA_PARALLEL tables build fbgemm's ``DenseTableBatchedEmbeddingBags
  Codegen`` on CPU (``torch.randn`` of the whole table);
* EmbeddingCollection keeps the plan's ``cpu``/``cuda`` placements while its tensors are on
  meta ("Local shard tensor device does not match with local Shard's placement");
* ``EmbeddingCollection(device="meta")`` (a string) makes the sharder call
  ``load_state_dict(module.state_dict())`` on meta tensors ("Cannot copy out of meta tensor").

``shard_on_meta`` constructs the DMP while every floating point factory call aimed at the CPU
goes to meta (``meta_factories``; integer metadata such as offsets stays real, the
constructors read it), rewrites the plan's placements to meta (a copy), normalises the
modules' ``device`` attributes, and defers DMP's own DDP wrap to ``materialize``.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..._gcpause import gc_paused
from ..device import this_ranks_gpu
from .fastbuild import linear_table_optimizers
from .fastnames import indexed_table_names
from .fastranks import indexed_group_ranks
from .host_kernels import host_dense_kernels
from .mc_sharding import mc_sharding_on_meta
from .module_kinds import refuse_unsupported_modules, refuse_unsupported_plan
from .meta_plan import plan_to_meta
from .two_dim import build_dmp_collection, check_group_plan, check_two_dim, node_size
from .meta_factories import MetaFactories

__all__ = ["shard_on_meta", "shard_modules_on_meta", "MetaDDP", "building_on_meta",
           "plan_to_meta", "this_ranks_gpu"]

_META = torch.device("meta")


class MetaDDP(DistributedDataParallel):
    """DDP built around meta parameters: no init collectives; remembers its arguments.

    ``materialize`` replaces it with a real ``DistributedDataParallel`` built from
    ``metamat_kwargs`` once the parameters are real (a DDP reducer built on meta buckets
    cannot be reused).
    """

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("MetaDDP takes keyword arguments only after module")
        _modern_buffer_sync(kwargs)
        self.metamat_kwargs = dict(kwargs)
        kwargs["init_sync"] = False
        super().__init__(module, **kwargs)


def _modern_buffer_sync(kwargs: Dict[str, Any]) -> None:
    """TorchRec passes ``broadcast_buffers``, which torch >= 2.13 deprecates (a FutureWarning
    per DDP) for ``forward_sync_buffers``. Every DDP metamat builds has ``init_sync=False``, so
    the init-time buffer sync (the one difference between the two) never runs: the same
    behaviour under the new name, where this torch has it."""
    if "broadcast_buffers" in kwargs and _DDP_HAS_FORWARD_SYNC \
            and kwargs.get("forward_sync_buffers") is None:
        value = kwargs.pop("broadcast_buffers")
        if value is not None:
            kwargs["forward_sync_buffers"] = bool(value)


_DDP_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(
    DistributedDataParallel.__init__).parameters


# TorchRec modules that wrap DATA_PARALLEL lookups in DDP at construction.
_DDP_USERS = ("torchrec.distributed.embeddingbag", "torchrec.distributed.embedding")


def _normalise_devices(module: nn.Module) -> Dict[nn.Module, Any]:
    """Turn string ``device`` attributes equal to "meta" into ``torch.device("meta")``.

    Returns the old values so a failed call can put them back.
    """
    old: Dict[nn.Module, Any] = {}
    for m in module.modules():
        for attr in ("_device", "device"):
            val = m.__dict__.get(attr)
            if isinstance(val, str) and torch.device(val).type == "meta":
                old[(m, attr)] = val
                m.__dict__[attr] = _META
    return old


# torch's _apply_optimizer_in_backward: the attributes TorchRec's sharders read off a table
_IN_BACKWARD_CHOICE = ("_optimizer_classes", "_optimizer_kwargs")


def _to_meta_inplace(module: nn.Module) -> None:
    """Move floating-point parameters still on a real device to meta (their values are
    dropped: ``materialize`` initialises them). Buffers keep their device and values
    (e.g. DLRM's ``triu_indices``)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type != "meta" and p.is_floating_point():
                new = nn.Parameter(torch.empty_like(p, device=_META),
                                   requires_grad=p.requires_grad)
                # the optimizer _apply_optimizer_in_backward chose (the sharders read it);
                # not its optimizer objects, which hold the old tensor
                for attr in _IN_BACKWARD_CHOICE:
                    if attr in p.__dict__:
                        setattr(new, attr, p.__dict__[attr])
                m._parameters[name] = new


def _default_plan(module: nn.Module, env: Any, sharders: Optional[List[Any]],
                  compute_device: str, group: Optional[Tuple[int, int]] = None):
    """TorchRec's planner, as ``DistributedModelParallel(module)`` without a plan runs it, but
    for the device the tables will be materialized on (its ``Topology`` refuses "meta");
    ``group``: (ranks, ranks a node) of the one sharding group a 2D plan is for. Rank 0 of
    the env's process group plans, every rank gets its plan."""
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.model_parallel import get_default_sharders
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    sharders = sharders if sharders is not None else get_default_sharders()
    world, local = group or (env.world_size, get_local_size(env.world_size))
    planner = EmbeddingShardingPlanner(topology=Topology(
        local_world_size=local, world_size=world, compute_device=compute_device))
    return _plan_on_rank0(planner, module, sharders, getattr(env, "process_group", None))


def _plan_on_rank0(planner: Any, module: nn.Module, sharders: List[Any], pg: Any):
    """TorchRec's ``collective_plan`` (rank 0 plans, the others receive its plan), except that
    a planner error on rank 0 reaches every rank instead of leaving them waiting for a plan
    until the process group times out."""
    if pg is None:
        return planner.plan(module, sharders)
    box: List[Any] = [None]
    error: Optional[BaseException] = None
    if dist.get_rank(pg) == 0:
        try:
            box = [("plan", planner.plan(module, sharders))]
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, raised here below
            error, box = e, [("error", f"{type(e).__name__}: {e}")]
    if dist.get_world_size(pg) > 1:
        # NCCL carries the pickled plan on a GPU: this rank's (torch would take the current
        # device, cuda:0 on every rank that never called set_device)
        gpu = this_ranks_gpu(torch.device("cuda")) \
            if "nccl" in str(dist.get_backend(pg)) else None
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg, device=gpu)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise RuntimeError(f"shard_on_meta: TorchRec's planner failed on rank 0: {value}")
    return value


@contextlib.contextmanager
def building_on_meta(cuda: Optional[torch.device] = None):
    """While active, TorchRec shards modules on meta: floating factories go to meta, lookups
    get ``MetaDDP``, and TorchRec's quadratic steps are linear. ``cuda``: the GPU the tables
    are laid out for (fbgemm's CUDA layout, ``cuda_kernels``), else fbgemm's CPU layout.
    Yields the list of TBE records of the CUDA layout (None for the CPU one)."""
    from . import upstream

    upstream.require("train")  # every name patched below, before any is
    with contextlib.ExitStack() as stack:  # each patch undone on every exit path
        for name in _DDP_USERS:
            stack.enter_context(upstream.patch(name, "DistributedDataParallel", MetaDDP))
        records = None
        if cuda is not None:
            from .cuda_kernels import (cuda_dense_kernels, cuda_fused_kernels,
                                       register_meta_flush)

            register_meta_flush()
            records = stack.enter_context(cuda_fused_kernels(cuda.index))
            stack.enter_context(cuda_dense_kernels())
        else:
            # the CPU layout, data-parallel tables included, also on a GPU host
            stack.enter_context(host_dense_kernels())
        stack.enter_context(MetaFactories(cuda=cuda is not None))
        stack.enter_context(mc_sharding_on_meta(cuda))  # managed collision: zch sizes exchanged
        stack.enter_context(gc_paused())  # ~100 live objects per table: see _gcpause
        stack.enter_context(linear_table_optimizers())  # TorchRec's is quadratic
        stack.enter_context(indexed_table_names())  # its name filter too
        stack.enter_context(indexed_group_ranks())  # torch's placement check: per world
        yield records


def shard_on_meta(
    module: nn.Module,
    env: Any = None,
    plan: Any = None,
    sharders: Optional[List[Any]] = None,
    compute_device: Optional[str] = None,
    sharding_group_size: Optional[int] = None,
    _composable: bool = False,
    **dmp_kwargs: Any,
):
    """Shard ``module`` with TorchRec, keeping every table, optimizer state and dense
    parameter on the meta device (no table memory is allocated).

    Args:
        module: an ``nn.Module`` holding EmbeddingBagCollection / EmbeddingCollection
            (typically built with ``device="meta"``; real tensors are moved to meta, which
            drops their values).
        env: a TorchRec ``ShardingEnv``; defaults to the default process group.
        plan: a TorchRec ``ShardingPlan``; default: TorchRec's planner, as DMP runs it
            (collectively over ``env``), planning for ``compute_device``.
        sharders: TorchRec sharders; default: DMP's defaults.
        compute_device: the device the tables will be materialized on, for the planner
            (default "cuda" when a GPU is visible, else "cpu"; materialize's default too).
            Given explicitly as "cuda" (or "cuda:N"), the tables are laid out for fbgemm's
            CUDA kernels (``EmbeddingLocation`` DEVICE / MANAGED / MANAGED_CACHING from each
            table's compute kernel ``fused`` / ``fused_uvm`` / ``fused_uvm_caching``, see
            ``cuda_kernels``), still all on meta; left at None, the CPU layout (HOST) is
            built as before, whatever the planner chose.
        sharding_group_size: build TorchRec's 2D parallelism, a ``DMPCollection``: the
            tables are sharded over groups of this many ranks by ``plan`` (a plan for one
            group, as ``DMPCollection`` takes it; default: TorchRec's planner for one group
            of GPUs) and each group is a replica (``sync()`` averages them). Needs
            ``compute_device="cuda"``, as TorchRec does.
        **dmp_kwargs: forwarded to ``DistributedModelParallel`` (``device``,
            ``init_parameters`` and ``init_data_parallel`` are fixed by this function), or
            to ``DMPCollection`` with ``sharding_group_size`` (``sharding_strategy``,
            ``node_group_size``, ``use_inter_host_allreduce``,
            ``submodule_configs``, ...; ``world_size`` and ``global_pg`` are the env's).

    Returns:
        A ``DistributedModelParallel`` (a ``DMPCollection`` with ``sharding_group_size``) on
        meta, ready for ``metamat.materialize``. Its dense DDP wrap happens in
        ``materialize``.

    Raises:
        metamat.UnsupportedError: unsupported torchrec/fbgemm version; with a CUDA
            compute device, a table whose compute kernel is not fused / fused_uvm /
            fused_uvm_caching; a managed-collision module other than MCH and HashZch; a
            TorchRec module type it cannot build with a sharder for it in use
            (EmbeddingTower[Collection], ITEP collections, tensor pools) or a
            FusedEmbeddingBagCollection's data-parallel table (:mod:`.module_kinds`); with
            ``sharding_group_size``: what 2D parallelism on meta refuses
            (docs/TORCHREC_GPU.md).
        ValueError: ``dmp_kwargs`` names an argument fixed here; with
            ``sharding_group_size``: no CUDA compute device, a group size that does
            not divide the world size, a plan for more ranks than one group, or (with
            table-row-wise or grid tables) nodes that do not divide the group.
    """
    from . import upstream

    upstream.require("train")  # the supported versions, every TorchRec/fbgemm name used
    from torchrec.distributed.model_parallel import (DistributedModelParallel,
                                                     get_default_sharders)
    from torchrec.distributed.types import ShardingEnv

    refuse_unsupported_modules(module, sharders if sharders is not None
                               else get_default_sharders())

    fixed_args = ("device", "init_parameters", "init_data_parallel")
    if sharding_group_size is not None:
        fixed_args += ("world_size", "global_pg")
    for fixed in fixed_args:
        if fixed in dmp_kwargs:
            raise ValueError(f"shard_on_meta: {fixed!r} is fixed by shard_on_meta")
    if env is None:
        if not dist.is_initialized():
            raise RuntimeError("shard_on_meta: no env given and no default process group")
        env = ShardingEnv.from_process_group(dist.group.WORLD)
    if _composable and compute_device is None and torch.cuda.is_available():
        compute_device = "cuda"  # the layout is final: only a DMP can be laid out again
    cuda_layout = compute_device is not None and torch.device(compute_device).type == "cuda"
    if sharding_group_size is not None:
        check_two_dim(module, env, plan, cuda_layout, sharding_group_size, dmp_kwargs)
    if cuda_layout:
        compute_device = this_ranks_gpu(torch.device(compute_device))
    if plan is None and sharding_group_size is not None:  # one group's plan, nodes as 2D's
        node = node_size(dmp_kwargs.get("node_group_size"), env.world_size)
        plan = _default_plan(module, env, sharders, "cuda", (
            sharding_group_size, node if sharding_group_size % node == 0 else
            sharding_group_size))
        check_group_plan("TorchRec's plan", plan, sharding_group_size, env.world_size,
                         dmp_kwargs.get("node_group_size"))
    elif plan is None:
        if compute_device is None:
            compute_device = "cuda" if torch.cuda.is_available() else "cpu"
        # plan on the module as built (meta tables are fine: only shapes are read)
        plan = _default_plan(module, env, sharders, torch.device(compute_device).type)
    refuse_unsupported_plan(module, plan)
    if cuda_layout:
        from .cuda_kernels import check_cuda_plan

        check_cuda_plan(plan)
    rank_devices: Dict[int, torch.device] = {}
    # a DMPCollection places the group's plan on global ranks: recorded once it has
    plan = plan_to_meta(plan, rank_devices if sharding_group_size is None else None)
    old_devices = _normalise_devices(module)
    try:
        _to_meta_inplace(module)
        with building_on_meta(compute_device if cuda_layout else None) as records:
            if _composable:  # TorchRec's shard_modules: the module itself, no DMP around it
                from torchrec.distributed.shard import shard_modules

                dmp = shard_modules(module, env=env, device=_META, plan=plan,
                                    sharders=sharders)
            elif sharding_group_size is None:
                dmp = DistributedModelParallel(
                    module,
                    env=env,
                    device=_META,
                    plan=plan,
                    sharders=sharders,
                    init_parameters=False,
                    init_data_parallel=False,
                    **dmp_kwargs,
                )
            else:
                dmp = build_dmp_collection(module, env, compute_device, plan, sharders,
                                           sharding_group_size, rank_devices, dmp_kwargs)
        if not _composable:
            upstream.check_dmp(dmp)  # the DMP internals relayout reads
    except BaseException:
        for (m, attr), val in old_devices.items():
            m.__dict__[attr] = val
        raise
    if not _composable:  # DMP's dense DDP wrap: made by materialize (shard_modules has none)
        dmp._metamat_defer_ddp = True
    if cuda_layout:
        # The layout is fbgemm's CUDA one: materialize must put it on a CUDA device.
        dmp._metamat_compute_device = compute_device
        dmp._metamat_cuda_tbes = records
        dmp._metamat_rank_devices = rank_devices
    return dmp


def shard_modules_on_meta(
    module: nn.Module,
    env: Any = None,
    plan: Any = None,
    sharders: Optional[List[Any]] = None,
    compute_device: Optional[str] = None,
) -> nn.Module:
    """TorchRec's composable sharding, ``torchrec.distributed.shard_modules``, on meta: the
    embedding collections of ``module`` are replaced by their sharded forms in place, with
    every table and optimizer state on meta, and nothing is wrapped around the module. Its
    dense part is the caller's: wrap it after this call (FSDP2's ``fully_shard`` works on
    meta; DDP needs real parameters, so after ``materialize``), since real dense parameters
    are moved to meta here. ``metamat.materialize(module)`` then fills both.

    Args:
        module, env, plan, sharders: as for :func:`shard_on_meta` (which also says what is
            refused, before anything is built).
        compute_device: as for :func:`shard_on_meta`, except that left at None it is
            "cuda" where a GPU is visible (the tables' layout is final here: only a
            ``DistributedModelParallel`` can be laid out for a GPU again).

    Returns:
        The sharded module: ``module`` itself, or its sharded form when ``module`` is itself
        an embedding collection (use the returned object).
    """
    return shard_on_meta(module, env=env, plan=plan, sharders=sharders,
                         compute_device=compute_device, _composable=True)
