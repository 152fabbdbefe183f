"""Which device a call materializes on, from the model and the ``device=`` argument."""
from __future__ import annotations

import itertools
from typing import Tuple

import torch
from torch import nn

from .. import emulation
from ..errors import UnsupportedError
from .modules import is_dtensor, local_of

__all__ = ["resolve_device", "has_meta"]


def has_meta(model: nn.Module) -> bool:
    """Whether ``model`` holds a meta tensor."""
    # stops at the first meta tensor: a sharded model lists its tables lazily
    return any(local_of(t).device.type == "meta"
               for t in itertools.chain(model.parameters(), model.buffers()))


def resolve_device(model: nn.Module, device) -> Tuple[torch.device, bool]:
    """(device, emulated): the explicit device; else the CUDA device a TorchRec model was laid
    out for; else where an eager model lives; else a DTensor mesh's device type; else the
    current CUDA device when there is one, else the CPU. ``emulated``: a CUDA device stood
    in for by the CPU (:mod:`metamat.emulation`)."""
    if device is None:
        device = getattr(model, "_metamat_compute_device", None)
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
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    device, emulated = emulation.resolve(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"materialize: device {device} asked for, and torch sees no "
                               "CUDA device here (torch.cuda.is_available() is False)")
    return device, emulated
