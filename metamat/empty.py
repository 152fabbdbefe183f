"""``init_empty_weights``: build a model with its parameters on meta and its buffers real.

The convention users know from accelerate and transformers: inside the context every
parameter a module registers is moved to the meta device right away, while buffers (by
default) stay real, so values computed at construction (a rotary embedding's ``inv_freq``,
position ids) survive and ``metamat.materialize`` keeps them (moving them to its device).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["init_empty_weights"]

_META = torch.device("meta")


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Context under which ``nn.Module`` parameters are created on the meta device.

    Args:
        include_buffers: also send buffers to meta (their values are then lost: metamat
            needs a checkpoint, an ``init=`` entry or the module's own reset to give them
            values, and says which are missing).

    Each parameter is still constructed (and initialised by its module) where the module
    puts it, then moved to meta as it is registered: this costs the construction time, not
    the memory. Not thread-safe (it patches ``nn.Module.register_parameter``).

    Yields:
        None; the patch is undone when the context ends.

    Example:
        >>> import metamat, torch
        >>> with metamat.init_empty_weights():
        ...     layer = torch.nn.Linear(4, 2)
        >>> layer.weight.is_meta
        True
    """
    old_param = nn.Module.register_parameter
    old_buffer = nn.Module.register_buffer

    def register_parameter(module, name, param):
        old_param(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            extra = dict(p.__dict__)
            new = type(p)(p.to(_META), requires_grad=p.requires_grad)
            new.__dict__.update(extra)
            module._parameters[name] = new

    def register_buffer(module, name, buffer, persistent=True):
        old_buffer(module, name, buffer, persistent=persistent)
        if buffer is not None:
            module._buffers[name] = module._buffers[name].to(_META)

    nn.Module.register_parameter = register_parameter
    if include_buffers:
        nn.Module.register_buffer = register_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter = old_param
        nn.Module.register_buffer = old_buffer
