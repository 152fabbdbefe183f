"""Which device a call materializes on, from the model and the ``device=`` argument."""
from __future__ import annotations

import itertools
import os
from typing import Tuple

import torch
from torch import nn

from .. import emulation
from ..errors import UnsupportedError
from .modules import is_dtensor, local_of

__all__ = ["resolve_device", "has_meta", "this_ranks_gpu"]


def has_meta(model: nn.Module) -> bool:
    """Whether ``model`` holds a meta tensor."""
    # stops at the first meta tensor: a sharded model lists its tables lazily
    return any(local_of(t).device.type == "meta"
               for t in itertools.chain(model.parameters(), model.buffers()))


def this_ranks_gpu(device: torch.device) -> torch.device:
    """``cuda`` without an index is this rank's GPU: the current CUDA device where
    ``torch.cuda.set_device`` chose one other than cuda:0, else ``cuda:LOCAL_RANK`` under
    torchrun (when that GPU exists), else cuda:0; without a visible GPU it stays ``cuda``.
    (cuda:0 current on every rank is what a rank that never called set_device has.)"""
    if device.index is not None or not torch.cuda.is_available():
        return device
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if current == 0 and local is not None and local.isdigit() and \
            int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", current)


def resolve_device(model: nn.Module, device) -> Tuple[torch.device, bool]:
    """(device, emulated): the explicit device; else the CUDA device a TorchRec model was laid
    out for; else where an eager model lives; else a DTensor mesh's device type; else this
    rank's GPU (:func:`this_ranks_gpu`) when there is one, else the CPU. ``cuda`` without an
    index is the GPU the model was laid out for, else this rank's GPU. ``emulated``: a CUDA
    device stood in for by the CPU (:mod:`metamat.emulation`).

    Raises:
        UnsupportedError: a GPU other than the one the model's tables were laid out for (the
            plan places this rank's shards there), or CUDA asked for where torch sees none.
    """
    laid = getattr(model, "_metamat_compute_device", None)
    if device is None:
        device = laid
    if device is None:
        # only asked without an explicit device: listing a DMP's parameters goes through
        # TorchRec's named_parameters (~7 µs per table)
        if not has_meta(model):
            real = next((t for t in list(model.parameters()) + list(model.buffers())), None)
            if real is not None:
                device = local_of(real).device
        if device is None:
            mesh_dev = next((t.device_mesh.device_type for t in model.parameters()
                             if is_dtensor(t)), None)
            device = mesh_dev or ("cuda" if torch.cuda.is_available() or emulation.active()
                                  else "cpu")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize: device must be a real device, not meta")
    laid = torch.device(laid) if laid is not None else None
    if device.type == "cuda" and laid is not None and laid.type == "cuda" and \
            laid.index is not None:
        if device.index is None:
            device = laid
        elif device.index != laid.index:
            raise UnsupportedError(
                f"materialize: device {device} asked for, and this model's TorchRec tables "
                f"were laid out for {laid} (shard_on_meta: the plan places this rank's shards "
                f"there); materialize it on {laid}, or shard it with compute_device='{device}'")
    if device.type == "cuda" and device.index is None:
        device = this_ranks_gpu(device)
    device, emulated = emulation.resolve(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"materialize: device {device} asked for, and torch sees no "
                               "CUDA device here (torch.cuda.is_available() is False)")
    return device, emulated
