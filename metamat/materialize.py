"""``metamat.materialize``: turn a model holding meta tensors into a real, initialised one.

Pipeline: plan (find every meta tensor, validate, compute targets) -> allocate (one real
storage per meta storage, nothing touched) -> fill (init engine, or checkpoint load) ->
register (swap the real tensors in everywhere). A failure before register leaves the model
as it was.
"""
from __future__ import annotations

import time
import warnings as _warnings
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from .report import Report
from .spec import Dist

__all__ = ["materialize"]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(
    model: nn.Module,
    ckpt: Any = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    seed: int = 0,
    init: Optional[Mapping[str, Dist]] = None,
) -> Report:
    """Allocate and initialise every meta tensor of ``model`` in place.

    Args:
        model: a ``DistributedModelParallel`` from ``metamat.shard_on_meta`` or from
            ``DistributedModelParallel(..., device=torch.device("meta"),
            init_parameters=False)``, or any ``nn.Module`` holding meta tensors.
        ckpt: a checkpoint to load instead of initialising (not supported yet).
        device: target device; default the current CUDA device if available, else CPU.
        seed: RNG seed; values are a pure function of (seed, table name, global row/col).
        init: fnmatch patterns of table names or parameter fqns -> metamat distributions,
            overriding the model's own init.

    Returns:
        A ``Report`` (bytes written, seconds per phase, GB/s).

    Raises:
        NotImplementedError: ``ckpt`` given.
        metamat.torchrec.compat.UnsupportedError: unsupported version, kernel or module,
            raised before anything is allocated.
    """
    from .torchrec.allocate import allocate
    from .torchrec.fill import fill_init
    from .torchrec.register import register
    from .torchrec.walk import build_plan

    if ckpt is not None:
        raise NotImplementedError("materialize(ckpt=...) is not implemented yet")
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "meta":
        raise ValueError("materialize: device must be a real device, not meta")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    report = Report(device=str(device), source="init")

    t0 = time.perf_counter()
    plan = build_plan(model, device, init)
    t1 = time.perf_counter()
    alloc = allocate(plan)
    t2 = time.perf_counter()
    report.bytes_written = fill_init(plan, alloc, seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()
    register(model, plan, alloc)
    t4 = time.perf_counter()

    report.seconds = {"plan": t1 - t0, "allocate": t2 - t1, "fill": t3 - t2, "register": t4 - t3}
    report.bytes_allocated = plan.nbytes
    report.num_targets = len(plan.targets)
    report.num_tensors = len(alloc.twins)
    report.warnings = list(plan.warnings)
    for w in plan.warnings:
        _warnings.warn(w, stacklevel=2)
    return report
