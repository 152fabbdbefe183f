"""TorchRec's 2D parallelism (``DMPCollection``) built on meta.

``DMPCollection`` shards the tables over a *sharding group* of ``sharding_group_size`` ranks
and replicates that group ``world_size / sharding_group_size`` times; ``sync()`` averages the
replicas' tables and optimizer state. TorchRec builds it for GPUs only (it asserts a CUDA
or MTIA device) and allocates every table there. ``dmp_collection_on_meta`` builds it with
its DMP part on meta instead:

* the DMP constructor DMPCollection calls gets ``device=meta`` and the plan with meta
  placements (``plan_to_meta``, after DMPCollection has mapped the group's ranks to global
  ranks), so the tables are laid out for CUDA and allocated nowhere;
* where the process group has no NCCL backend (gloo ranks, as on the emulated GPU of
  ``metamat.emulation``) the 2D device mesh is a CPU mesh; with NCCL it is TorchRec's CUDA
  mesh;
* table-row-wise and grid shardings get their node groups (TorchRec's
  ``intra_and_cross_node_pg_2D``, which skips them on meta) while they are built, as on GPUs:
  the node size those shardings lay their tables out with is the groups' size, which a meta
  build would otherwise guess from the sharding group alone;
* with the ``FULLY_SHARDED`` strategy, the CUDA stream its kernels make on the device of the
  tables (meta) is a :class:`NoStream` until registration makes it on the tables' GPU.

Like the other patches of ``building_on_meta``, these replace class and module attributes
(``torch.cuda.Stream`` too) for the whole process while the model is built: build models from
one thread at a time.

Values need nothing special: metamat's values are keyed by global row and column, so every
replica of a shard gets the same bytes, from init or from a checkpoint. The tables' DTensors
(TorchRec's ``LocalShardsWrapper``: none, one or several shards a rank) are read shard by
shard (``targets.local_blocks``), and the tensor lists ``sync()`` reduces, which TorchRec
cached while it built the model, are views of the tables' storage like any other and get
their real twins at registration.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from ...errors import UnsupportedError
from . import upstream
from .meta_plan import plan_to_meta

__all__ = ["build_dmp_collection", "check_group_plan", "check_two_dim", "dmp_collection_on_meta",
           "node_size"]

_META = torch.device("meta")
MODEL_PARALLEL = "torchrec.distributed.model_parallel"
#: sharding types with node groups (intra- and cross-node process groups)
_NODE_GROUPED = ("table_row_wise", "grid_shard")
_NODE_GROUPS = "intra_and_cross_node_pg_2D"


class NoStream:
    """What a FULLY_SHARDED kernel built on meta holds for its CUDA stream until
    registration makes the real one on the device its weights went to (on the emulated
    device, whose models never run a forward, it stays)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"NoStream({self.device}: made at registration)"


def _streams_on_meta(compute_device: torch.device):
    """``torch.cuda.Stream`` while a FULLY_SHARDED model is built: TorchRec makes each
    kernel's stream on the device of its weights, meta then; that one is a :class:`NoStream`
    naming ``compute_device`` (no CUDA context is opened while building)."""
    real = torch.cuda.Stream

    def stream(device: Any = None, *args: Any, **kwargs: Any):
        if device is not None and torch.device(device).type == "meta":
            return NoStream(compute_device)
        return real(device, *args, **kwargs)
    return stream


@contextlib.contextmanager
def dmp_collection_on_meta(rank_devices: Dict[int, torch.device], cpu_mesh_only: bool,
                           compute_device: torch.device,
                           fully_sharded: bool = False) -> Iterator[None]:
    """While active, a ``DMPCollection`` built for CUDA shards on meta (module docstring).
    ``rank_devices`` receives each global rank's CUDA device as the remapped plan placed it;
    ``cpu_mesh_only``: the process group has no NCCL backend (the emulated GPU's gloo ranks),
    so the 2D mesh is built for the CPU; ``fully_sharded``: the FULLY_SHARDED strategy, whose
    kernels hold a :class:`NoStream` naming ``compute_device`` until registration."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from .. import torch_upstream

    dmp_init = DistributedModelParallel.__dict__["__init__"]

    @functools.wraps(dmp_init)
    def init_on_meta(self, module, env=None, device=None, plan=None, *args, **kwargs):
        if plan is not None:
            plan = plan_to_meta(plan, rank_devices)
        return dmp_init(self, module, env, _META, plan, *args, **kwargs)

    def cpu_mesh(device_type: str, *args: Any, **kwargs: Any):
        return DeviceMesh("cpu", *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(upstream.patch(upstream.DMP, "__init__", init_on_meta))
        for mod in (upstream.TWRW_MODULE, upstream.GRID_MODULE):
            stack.enter_context(upstream.patch(mod, _NODE_GROUPS, _node_groups_as_on_gpus))
        if cpu_mesh_only:
            stack.enter_context(upstream.patch(MODEL_PARALLEL, "DeviceMesh", cpu_mesh))
        if fully_sharded:
            stack.enter_context(torch_upstream.patch("torch.cuda", "Stream",
                                                     _streams_on_meta(compute_device)))
        yield


def _node_groups_as_on_gpus(env: Any, device: Optional[torch.device] = None):
    """TorchRec's 2D node groups, created whatever the device: a collective every rank
    reaches in the same order (each builds the same shardings). TorchRec keeps one pair per
    process, made for the first sharding that asks: a later one that needs other nodes (a
    submodule config's group, another model) is refused here, where TorchRec would lay its
    tables out over the first one's nodes."""
    from torchrec.distributed import comm

    intra, cross = getattr(comm, _NODE_GROUPS)(env, device=None)
    node = node_size(env.node_group_size, dist.get_world_size())
    group = dist.get_process_group_ranks(env.sharding_pg)
    have = dist.get_process_group_ranks(intra)
    if len(have) != node or not set(have) <= set(group):
        raise UnsupportedError(
            f"shard_on_meta: a table-row-wise or grid sharding in sharding group {group} needs "
            f"nodes of {node} ranks, but this process's node group is {have}: TorchRec keeps "
            "one node group a process, made for the first such sharding (another "
            "submodule config, or a model built before), and would lay these tables out over "
            "it; build every table-row-wise and grid table with the same sharding group and "
            "node size in one process")
    return intra, cross


def node_size(node_group_size: Optional[int], world: int) -> int:
    """The ranks of a node TorchRec gives table-row-wise and grid sharding under 2D:
    ``node_group_size``, else the local world size (``LOCAL_WORLD_SIZE``; unset, TorchRec
    takes 8, or the world size where 8 does not divide it)."""
    from torchrec.distributed.comm import get_local_size

    return node_group_size or get_local_size(world)


def check_two_dim(module: Any, env: Any, plan: Any, cuda_layout: bool,
                  sharding_group_size: int, kwargs: Dict[str, Any]) -> None:
    """What ``shard_on_meta(sharding_group_size=...)`` needs, checked before anything is built:
    TorchRec's ``DMPCollection`` runs on GPUs only and takes the sharding group's plan (none:
    shard_on_meta plans one); the group size divides the world size; managed collision needs
    torchrec 1.8 or later; table-row-wise and grid sharding need nodes that tile the group.
    Each of ``submodule_configs`` (a module type's own plan and sharding group) is checked
    the same way, and plans a module of its own type only."""
    from .cuda_kernels import check_cuda_plan

    if not cuda_layout:
        raise ValueError("shard_on_meta: sharding_group_size builds TorchRec's DMPCollection, "
                         "which runs on GPUs only: pass compute_device='cuda'")
    world = env.world_size
    _check_group("sharding_group_size", sharding_group_size, world)
    configs = kwargs.get("submodule_configs") or []
    if plan is not None:  # else shard_on_meta plans one group (and checks that plan)
        check_group_plan("the plan", plan, sharding_group_size, world,
                         kwargs.get("node_group_size"))
    elif configs:
        raise ValueError("shard_on_meta: with submodule_configs, give the plan of the modules "
                         "they leave out (a planner would plan those modules twice)")
    for cfg in configs:
        what = f"the submodule config of {getattr(cfg.module, '__name__', cfg.module)}"
        _check_group(f"{what}: its sharding_group_size", cfg.sharding_group_size, world)
        # TorchRec makes a config's whole sharding group one node
        check_group_plan(f"{what}: its plan", cfg.plan, cfg.sharding_group_size, world,
                         cfg.sharding_group_size)
        check_cuda_plan(cfg.plan)  # shard_on_meta checks the main plan
    _check_config_paths(module, plan, configs)
    _check_managed_collision(module)


def _check_config_paths(module: Any, plan: Any, configs: List[Any]) -> None:
    """TorchRec shards a module in the context of its type (the submodule config of that
    type, else the default one), whichever plan names it: a plan entry built in another
    context's sharding group than the one it was planned for is refused."""
    if not configs:
        return
    types = {p: type(m) for p, m in module.named_modules()}
    contexts = [("the plan", plan, None)] + [
        (f"the submodule config of {getattr(c.module, '__name__', c.module)}", c.plan, c.module)
        for c in configs]
    for what, p, owner in contexts:
        for path in p.plan:
            t = types.get(path)
            shards_it = next((o for _, _, o in contexts[1:] if o is t), None)
            if t is not None and shards_it is not owner:
                where = (f"the submodule config of {shards_it.__name__}" if shards_it
                         else "the default context")
                raise ValueError(
                    f"shard_on_meta: {what} plans {path or '<root>'} ({t.__name__}), which "
                    f"DMPCollection shards in {where} (by module type): give its plan there")


def _check_group(what: str, size: Any, world: int) -> None:
    if not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"shard_on_meta: {what} {size!r} must divide the world size {world}")


def _is_fully_sharded(strategy: Any) -> bool:
    return strategy is not None and getattr(strategy, "name", strategy) == "FULLY_SHARDED"


def check_group_plan(what: str, plan: Any, group: int, world: int,
                     node_group_size: Optional[int]) -> None:
    """A plan for one sharding group of ``group`` ranks, whose table-row-wise and grid tables
    have nodes that tile the group."""
    params = [(f"{path or '<root>'}.{table}", ps) for path, module_plan in plan.plan.items()
              if hasattr(module_plan, "items") for table, ps in module_plan.items()]
    beyond = max((int(r) for _, ps in params for r in (getattr(ps, "ranks", None) or [])),
                 default=-1)
    if beyond >= group:
        raise ValueError(
            f"shard_on_meta: {what} places shards on rank {beyond}, but a sharding group "
            f"has {group} ranks: give the plan of one group (planned for world_size={group}), "
            "as DMPCollection takes it")
    node_grouped = sorted(name for name, ps in params
                          if getattr(ps, "sharding_type", None) in _NODE_GROUPED)
    if node_grouped:
        _check_node_size(node_grouped, world, group, node_group_size)


def _check_node_size(tables: List[str], world: int, group: int,
                     node_group_size: Optional[int]) -> None:
    """TorchRec splits a sharding group into nodes (:func:`node_size`) for table-row-wise and
    grid sharding, and asserts that they tile the group: checked here, before any group is
    created, with the tables named."""
    node = node_size(node_group_size, world)
    if node < 1 or group % node:
        where = "node_group_size" if node_group_size else (
            "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in os.environ
            else "TorchRec's guess with LOCAL_WORLD_SIZE unset")
        raise ValueError(
            f"shard_on_meta: table-row-wise and grid sharding under 2D parallelism split each "
            f"sharding group ({group} ranks) into nodes of {node} ranks ({where}), which "
            f"must divide it: {', '.join(tables)}; pass node_group_size=<a divisor of "
            f"{group}> or set LOCAL_WORLD_SIZE")


def _check_managed_collision(module: Any) -> None:
    """TorchRec before 1.8 gathers each MC table's size over the whole world, not the sharding
    group, under 2D (its own DMPCollection fails the same way): refused there by name."""
    import torchrec
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    version = tuple(int(x) for x in torchrec.__version__.split("+")[0].split(".")[:2])
    if version >= (1, 8):
        return
    for name, m in module.named_modules():
        if isinstance(m, ManagedCollisionCollection):
            raise UnsupportedError(
                f"shard_on_meta: managed-collision collection {name or '<root>'} under 2D "
                f"parallelism needs torchrec 1.8 or later (torchrec {torchrec.__version__} "
                "gathers its table sizes over the whole world, not the sharding group)")


def _with_plan_copy(config: Any) -> Any:
    config = copy.copy(config)
    config.plan = plan_to_meta(config.plan)
    return config


def build_dmp_collection(module: Any, env: Any, compute_device: torch.device, plan: Any,
                         sharders: Optional[List[Any]], sharding_group_size: int,
                         rank_devices: Dict[int, torch.device], kwargs: Dict[str, Any]):
    """TorchRec's ``DMPCollection`` of ``module`` with its tables on meta (module docstring):
    the caller has entered ``building_on_meta``; ``plan`` is a copy the remap may change."""
    from torchrec.distributed.model_parallel import DMPCollection

    configs = kwargs.get("submodule_configs")
    if configs:  # TorchRec remaps their plans in place: give it copies, as for ``plan``
        kwargs = dict(kwargs, submodule_configs=[_with_plan_copy(c) for c in configs])
    pg = env.process_group
    fully = any(_is_fully_sharded(s) for s in [kwargs.get("sharding_strategy")] + [
        c.sharding_strategy for c in configs or []])
    with dmp_collection_on_meta(rank_devices, "nccl" not in dist.get_backend(pg),
                                compute_device, fully):
        return DMPCollection(
            module,
            device=compute_device,
            plan=plan,
            world_size=env.world_size,
            sharding_group_size=sharding_group_size,
            global_pg=pg,
            sharders=sharders,
            init_parameters=False,
            init_data_parallel=False,
            **kwargs,
        )
