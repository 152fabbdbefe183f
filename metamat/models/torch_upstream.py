"""The one door to torch's internals that metamat's model adapters use.

TorchRec's and fbgemm's: :mod:`metamat.models.torchrec.upstream`; transformers':
:mod:`metamat.models.hf.upstream`; the machinery: :mod:`metamat.models.boundary`. Every private
name of torch the adapters read, call or replace is declared here once (:data:`DECLARED`),
with the torch versions it was checked on, and read through this module's functions:

* FSDP2 (``fully_shard``): a module's ``_get_fsdp_state()``, its parameter groups
  (``_fsdp_param_groups``; torch 2.11 keeps one in ``_fsdp_param_group``), each FSDPParam's
  ``sharded_param``, padded ``_sharded_param_data`` and ``reset_sharded_param()``;
* DTensor: ``_local_tensor``, ``tensor._utils.compute_local_shape_and_global_offset``,
  ``_StridedShard``;
* TorchRec's sharded tensors: ``ShardedTensor._local_shards``, the ``_remote_device``
  placement and its fields, torch's shard metadata classes (the graph walk's), and the
  placement check ``_parse_and_validate_remote_device`` that ``fastranks`` replaces in the 3
  modules that call it, with ``distributed_c10d._rank_not_in_group``;
* the factories ``MetaFactories`` replaces (``torch.empty``, ...: public names, declared as
  patch sites), ``torch.utils._device._device_constructors``, ``Tensor._version``,
  ``torch._C._dispatch_has_kernel_for_dispatch_key``, ``UntypedStorage._cdata`` and
  ``Tensor._make_subclass`` (the last three also read directly by ``metamat.emulation``,
  ``metamat.plan.storage_key`` and ``metamat.allocate``, outside the adapters);
* ``nn.Module``'s own tables (``_parameters``, ``_buffers``, ``_modules``,
  ``_non_persistent_buffers_set``, the hook dicts, ``_save_to_state_dict``, ``_version``) and
  the optimizer's hook dicts: read directly by the adapters (they are how every library walks
  a module), declared here so a torch that renames one fails the check instead of a walk;
* ``nn.init``'s fan helpers and ``OpOverload._schema`` (the Hugging Face init trace).

Groups are checked at their first use (``require(group)``); instance attributes on the first
instance of each class an adapter finds, or on a cheap instance built for the check
(``nn.Module()``, a placement, a storage). Checked on torch 2.11.0, 2.12.1, 2.13.0 and 2.14.1
(``scripts/check_upstream.py``), except where a declaration says otherwise.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch import nn

from .boundary import Boundary, Private, apply_patch, patch as _patch

__all__ = ["BOUNDARY", "DECLARED", "TORCH", "require", "local_tensor", "local_shape_and_offset",
           "is_strided_shard", "fsdp_params", "fsdp_padded_shard", "fsdp_adopt",
           "REMOTE_DEVICE_FIELDS", "remote_device", "set_placement_device",
           "PLACEMENT_CHECK_CALLERS", "METADATA_CLASSES", "MODULE_HOOK_ATTRS",
           "OPTIMIZER_HOOK_ATTRS", "FACTORY_NAMES", "storage_id"]

TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")


def _versions() -> str:
    return f"torch {torch.__version__}"


BOUNDARY = Boundary("torch", _versions)


def _t(owner: str, name: str, kind: str, why: str, group: str, checked=TORCH, **kw) -> Private:
    return Private(owner, name, kind, tuple(checked), why, group, **kw)


FSDP = "torch.distributed.fsdp._fully_shard"
FSDP_STATE = f"{FSDP}._fsdp_state.FSDPState"
FSDP_GROUP = f"{FSDP}._fsdp_param_group.FSDPParamGroup"
FSDP_PARAM = f"{FSDP}._fsdp_param.FSDPParam"
DTENSOR = "torch.distributed.tensor.DTensor"
SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"
REMOTE_DEVICE = "torch.distributed.remote_device._remote_device"
C10D = "torch.distributed.distributed_c10d"
MODULE = "torch.nn.Module"
OPTIMIZER = "torch.optim.Optimizer"

#: ``_remote_device``'s fields (a shard placement "rank:N/device"): read by the graph walk,
#: fastbuild's copy and register's device fix; ``_device`` is rewritten to meta and back.
REMOTE_DEVICE_FIELDS = ("_worker_name", "_rank", "_device")
#: torch modules that call ``_parse_and_validate_remote_device`` through their own global name
#: (fastranks replaces it in each).
PLACEMENT_CHECK_CALLERS = ("torch.distributed._shard.sharded_tensor.utils",
                           "torch.distributed._shard.sharded_tensor.api",
                           "torch.distributed._shard.sharding_spec.chunk_sharding_spec")
PLACEMENT_CHECK = "_parse_and_validate_remote_device"
#: torch's shard metadata classes (the graph walk searches them for devices only).
METADATA_CLASSES = (
    "torch.distributed._shard.metadata.ShardMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.distributed._shard.sharding_spec.api.EnumerableShardingSpec",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
    REMOTE_DEVICE,
)
#: nn.Module's and Optimizer's hook registries (code, not state: the graph walk skips them).
MODULE_HOOK_ATTRS = ("_forward_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks",
                     "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                     "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                     "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
OPTIMIZER_HOOK_ATTRS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                        "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                        "_optimizer_load_state_dict_pre_hooks",
                        "_optimizer_load_state_dict_post_hooks")
#: Module tables the adapters read and write directly.
MODULE_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
#: torch factories MetaFactories replaces while a model is built on meta (public names).
FACTORY_NAMES = ("empty", "zeros", "ones", "full", "rand", "randn", "empty_strided",
                 "tensor", "as_tensor", "arange", "zeros_like", "ones_like", "full_like")
#: The marker torch's ``Module.state_dict`` reads from a post-hook (with the default False):
#: state_dict.py runs the same algorithm and reads it the same way.
HOOK_FROM_PUBLIC_API = "_from_public_api"

DECLARED: Tuple[Private, ...] = (
    # -- nn.Module / Optimizer internals (modules.py, module_values.py, state_dict.py, graph) --
    *[_t(MODULE, n, "attr", "the adapters read and swap a module's tensors", "module")
      for n in MODULE_TABLES],
    *[_t(MODULE, n, "attr", "the graph walk skips it; state_dict.py runs the hooks", "module")
      for n in MODULE_HOOK_ATTRS],
    *[_t(OPTIMIZER, n, "attr", "the graph walk skips it", "module")
      for n in OPTIMIZER_HOOK_ATTRS],
    _t(MODULE, "_save_to_state_dict", "method", "state_dict.py: a module's own tensors",
       "module"),
    _t(MODULE, "_version", "class_attr", "state_dict.py: the hooks' metadata", "module"),
    _t(MODULE, "state_dict", "method", "state_dict.py runs its algorithm (and reads the hooks' "
       f"{HOOK_FROM_PUBLIC_API} marker as it does, default False)", "module"),
    _t("torch.UntypedStorage", "_cdata", "attr", "a storage's identity (the plan's keys)",
       "module"),
    _t("torch.Tensor", "_version", "class_attr", "MetaFactories: a recorded value is stale "
       "once the tensor was written", "module"),
    _t("torch.Tensor", "_make_subclass", "method", "allocate.Allocation.twin: the real twin "
       "of a tensor subclass (read there directly)", "module"),
    # -- DTensor (modules.py, targets.py) ------------------------------------------------------
    _t(DTENSOR, "_local_tensor", "attr", "the rank's block, the object FSDP2 and the graph "
       "know", "dtensor"),
    _t("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "function",
       "the rank's block of a DTensor", "dtensor"),
    _t("torch.distributed.tensor.placement_types", "_StridedShard", "class",
       "refused: its local block is not one block of the global tensor", "dtensor"),
    # -- FSDP2 (modules.py, module_register.py) -------------------------------------------------
    _t("torch.distributed.fsdp.FSDPModule", "_get_fsdp_state", "method",
       "the module's FSDP state", "fsdp2"),
    _t(FSDP_STATE, "_fsdp_param_groups", "attr", "the state's parameter groups", "fsdp2",
       checked=("2.12.1", "2.13.0", "2.14.1"),
       optional="torch 2.11 keeps one group in _fsdp_param_group: fsdp_params() reads "
       "whichever is there and raises naming both when neither is"),
    _t(FSDP_STATE, "_fsdp_param_group", "attr", "torch 2.11's one parameter group", "fsdp2",
       checked=("2.11.0",), optional="the name of torch <= 2.11 (see _fsdp_param_groups)"),
    _t(FSDP_GROUP, "fsdp_params", "attr", "the group's FSDPParams", "fsdp2"),
    _t(FSDP_PARAM, "sharded_param", "attr", "the parameter FSDP manages (replaced)", "fsdp2"),
    _t(FSDP_PARAM, "_sharded_param_data", "attr", "the padded local shard: its storage is "
       "the one allocated, and FSDP keeps the new view", "fsdp2"),
    _t(FSDP_PARAM, "reset_sharded_param", "method", "FSDP re-reads the new parameter",
       "fsdp2"),
    # -- sharded tensors and placements (TorchRec's; graph.py, shard.py, register.py, fast*) --
    _t(SHARDED_TENSOR, "_local_shards", "attr", "a ShardedTensor has no storage of its own",
       "sharded_tensor"),
    *[_t(REMOTE_DEVICE, n, "attr", "a shard placement's fields (read; _device rewritten to "
         "meta while sharding and to the device at register)", "sharded_tensor")
      for n in REMOTE_DEVICE_FIELDS],
    *[_t(c.rpartition(".")[0], c.rpartition(".")[2], "class", "shard metadata the graph "
         "walk searches for devices only; fastbuild copies it", "sharded_tensor")
      for c in METADATA_CLASSES],
    *[_t(m, PLACEMENT_CHECK, "function", "fastranks: the group's ranks as a set",
         "sharded_tensor", patched=True) for m in PLACEMENT_CHECK_CALLERS],
    _t(C10D, "_rank_not_in_group", "function", "fastranks: torch's own test",
       "sharded_tensor"),
    # -- factories and the dispatcher (meta_factories.py, cuda_kernels.py) --------------------
    *[_t("torch", n, "function", "MetaFactories: floating factories go to meta",
         "factories", patched=True) for n in FACTORY_NAMES],
    _t("torch.utils._device", "_device_constructors", "function", "MetaFactories fills "
       "torch's cache of factories before replacing them", "factories"),
    _t("torch.cuda", "Stream", "class", "two_dim: a FULLY_SHARDED kernel's stream for a meta "
       "table is a placeholder until registration", "factories", patched=True),
    _t("torch._C", "_dispatch_has_kernel_for_dispatch_key", "function", "an existing Meta "
       "kernel of fbgemm::lxu_cache_flush is left alone", "dispatch"),
    # -- the Hugging Face init trace (hf/init_trace.py) ---------------------------------------
    _t("torch.nn.init", "_calculate_fan_in_and_fan_out", "function", "xavier's distribution",
       "init"),
    _t("torch.nn.init", "_calculate_correct_fan", "function", "kaiming's distribution", "init"),
    _t("torch.utils._python_dispatch", "TorchDispatchMode", "class", "sees the writes of "
       "an init", "init"),
    _t("torch._ops.OpOverload", "_schema", "attr", "which arguments an op writes", "init"),
)
BOUNDARY.declare(*DECLARED)
BOUNDARY.instance_factory(MODULE, nn.Module)
BOUNDARY.instance_factory(OPTIMIZER, lambda: torch.optim.SGD([nn.Parameter(torch.zeros(1))],
                                                              lr=0.1))
BOUNDARY.instance_factory("torch.UntypedStorage", lambda: torch.UntypedStorage(0))
BOUNDARY.instance_factory("torch._ops.OpOverload", lambda: torch.ops.aten.add.Tensor)


def _remote_device_instance() -> Any:
    from torch.distributed.remote_device import _remote_device

    return _remote_device("rank:0/cpu")


BOUNDARY.instance_factory(REMOTE_DEVICE, _remote_device_instance)


def require(group: str) -> None:
    """Check every name of ``group`` at its first use ("module", "dtensor", "fsdp2",
    "sharded_tensor", "factories", "dispatch", "init"). Raises UnsupportedError naming what is
    missing; allocates nothing."""
    BOUNDARY.require(group)


def site(owner: str, name: str) -> Private:
    return BOUNDARY.get_declared(owner, name)


def patch(owner: str, name: str, new: Any, **kw: Any):
    """Context manager: declared patch site ``owner.name`` is ``new`` while active."""
    return _patch(site(owner, name), new, **kw)


def apply(owner: str, name: str, new: Any, **kw: Any):
    """Replace declared patch site ``owner.name``; the caller undoes the returned Patch."""
    return apply_patch(site(owner, name), new, **kw)


# -- DTensor ---------------------------------------------------------------------------------

def local_tensor(t: Any) -> torch.Tensor:
    """The rank-local tensor of DTensor ``t`` (the object itself, not a view)."""
    BOUNDARY.check_instance(t)
    return t._local_tensor


def local_shape_and_offset(shape: Any, mesh: Any, placements: Any):
    """torch's (local shape, global offset) of a DTensor's block on this rank."""
    require("dtensor")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def is_strided_shard(p: Any) -> bool:
    """``p`` is a ``_StridedShard`` placement (FSDP2 over TP on the same dim)."""
    require("dtensor")
    from torch.distributed.tensor import placement_types

    return isinstance(p, placement_types._StridedShard)


# -- FSDP2 -----------------------------------------------------------------------------------

def _param_groups(state: Any) -> List[Any]:
    d = getattr(state, "__dict__", {})
    if "_fsdp_param_groups" in d:
        return list(d["_fsdp_param_groups"] or [])
    if "_fsdp_param_group" in d:  # torch 2.11
        g = d["_fsdp_param_group"]
        return [g] if g is not None else []
    raise BOUNDARY.error([(site(FSDP_STATE, "_fsdp_param_groups"), "missing on the instance"),
                          (site(FSDP_STATE, "_fsdp_param_group"), "missing on the instance")])


def fsdp_params(modules: Iterable[nn.Module]) -> Dict[int, Any]:
    """id(sharded parameter) -> FSDPParam, for every FSDP2 module among ``modules``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {}
    out: Dict[int, Any] = {}
    for m in modules:
        if not isinstance(m, FSDPModule):
            continue
        require("fsdp2")
        state = m._get_fsdp_state()
        for group in _param_groups(state):
            for fp in BOUNDARY.check_instance(group).fsdp_params:
                BOUNDARY.check_instance(fp)
                out[id(fp.sharded_param)] = fp
    return out


def fsdp_padded_shard(fp: Any) -> torch.Tensor:
    """The FSDPParam's padded local shard (the local tensor views a prefix of it)."""
    return fp._sharded_param_data


def fsdp_adopt(fp: Any, padded: torch.Tensor, param: Any) -> None:
    """Point the FSDPParam at the new padded shard and parameter; FSDP re-reads it
    (``reset_sharded_param``, what it runs after ``to_empty``)."""
    fp._sharded_param_data = padded
    fp.sharded_param = param
    fp.reset_sharded_param()


# -- sharded tensors and placements -----------------------------------------------------------

def remote_device(placement: str) -> Any:
    """torch's ``_remote_device`` of a placement string ("rank:0/cpu")."""
    from torch.distributed.remote_device import _remote_device

    return _remote_device(placement)


def set_placement_device(placement: Any, device: torch.device) -> None:
    """Make a ``_remote_device`` placement name ``device`` (its rank kept)."""
    placement._device = device


def placement_check_sites() -> List[Private]:
    """The declared patch sites of ``_parse_and_validate_remote_device``."""
    return [site(m, PLACEMENT_CHECK) for m in PLACEMENT_CHECK_CALLERS]


def rank_not_in_group(pg: Any) -> bool:
    from torch.distributed import distributed_c10d

    return distributed_c10d._rank_not_in_group(pg)


# -- factories, storages, dispatcher -----------------------------------------------------------

def prime_device_constructors() -> None:
    """Fill torch's cache of factory functions (``with torch.device(...)``) with the
    originals, before MetaFactories replaces them."""
    from torch.utils._device import _device_constructors

    _device_constructors()


def storage_id(st: Any) -> int:
    """An untyped storage's identity (``metamat.plan.storage_key`` of its tensors)."""
    return st._cdata


def has_kernel_for(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


# -- nn.init (the Hugging Face init trace) ----------------------------------------------------

def fan_in_and_fan_out(t: torch.Tensor) -> Tuple[int, int]:
    require("init")
    return torch.nn.init._calculate_fan_in_and_fan_out(t)


def correct_fan(t: torch.Tensor, mode: str) -> int:
    require("init")
    return torch.nn.init._calculate_correct_fan(t, mode)


def op_arguments(func: Any) -> Any:
    """The schema arguments of an op overload (which ones it writes: ``alias_info``)."""
    return func._schema.arguments


def dispatch_mode_class() -> type:
    require("init")
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode
