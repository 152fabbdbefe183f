"""Correct values for fbgemm TBE metadata buffers (offsets, placements, hash sizes, ...).

A TBE built on meta has meta metadata buffers: shapes but no values. Rather than re-derive
fbgemm's layout rules (which change between releases), we ask fbgemm: run the TorchRec
kernel wrapper's constructor far enough to capture the exact arguments it passes to the
fbgemm TBE class, then build that TBE on the target device inside ``NoFloatAllocMode`` (every
floating-point factory lands on meta, so no table or optimizer memory is touched), and read
the integer metadata it produced.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .compat import UnsupportedError

__all__ = ["NoFloatAllocMode", "capture_tbe_args", "rebuild_tbe_metadata"]

_META = torch.device("meta")
# Factory functions whose floating-point results are sent to meta. ``*_like`` and ``new_*``
# follow their input's device and need no redirect.
FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
              torch.empty_strided}
_FULL = torch.full  # bound once: meta_factories replaces ``torch.full`` while it is active


def floating_factory_call(func, args, kwargs) -> bool:
    """True for a factory call (torch.empty, zeros, full, ...) that makes a floating tensor."""
    if func not in FACTORIES or kwargs.get("out") is not None:
        return False
    dtype = kwargs.get("dtype")
    if dtype is None and func is _FULL:
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return isinstance(fill, float)
    return dtype.is_floating_point if dtype is not None else True


class NoFloatAllocMode(TorchFunctionMode):
    """Send floating-point factory calls (any device) to meta; leave integer ones alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if floating_factory_call(func, args, kwargs):
            kwargs["device"] = _META
        return func(*args, **kwargs)


class _Captured(Exception):
    def __init__(self, cls: type, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.cls, self.args, self.kwargs = cls, args, kwargs


def _tbe_classes() -> Dict[str, type]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return {
        "SplitTableBatchedEmbeddingBagsCodegen": SplitTableBatchedEmbeddingBagsCodegen,
        "DenseTableBatchedEmbeddingBagsCodegen": DenseTableBatchedEmbeddingBagsCodegen,
    }


def _config_copy(config: Any) -> Any:
    """A copy of a GroupedEmbeddingConfig the kernel constructor may write to: it adds keys to
    ``fused_params`` and reads the rest. A deep copy cost ~0.5 ms per table."""
    out = copy.copy(config)
    if getattr(config, "fused_params", None) is not None:
        out.fused_params = dict(config.fused_params)
    out.embedding_tables = list(config.embedding_tables)
    return out


def capture_tbe_args(wrapper: nn.Module, device: torch.device) -> Tuple[type, tuple, dict]:
    """Return (fbgemm class, args, kwargs) the TorchRec ``wrapper`` would build its TBE with
    on ``device``. Nothing is allocated: the constructor is stopped at the TBE call.
    """
    import contextlib

    from . import upstream

    classes = _tbe_classes()

    def make_stub(real: type):
        def stub(*args, **kwargs):
            raise _Captured(real, args, kwargs)

        return stub

    fresh = type(wrapper).__new__(type(wrapper))
    config, pg = upstream.kernel_config(wrapper), upstream.kernel_pg(wrapper)
    with contextlib.ExitStack() as stack:
        for name, real in classes.items():
            stack.enter_context(upstream.patch(upstream.BEK, name, make_stub(real)))
        try:
            with NoFloatAllocMode():
                type(wrapper).__init__(fresh, _config_copy(config), pg, device)
        except _Captured as cap:
            return cap.cls, cap.args, cap.kwargs
    raise UnsupportedError(
        f"{type(wrapper).__name__}: constructor did not build a known fbgemm TBE class"
    )


def _named_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for k, v in module.__dict__.items():
        if isinstance(v, torch.Tensor):
            out[k] = v
    for k, v in module._parameters.items():
        if v is not None:
            out[k] = v
    for k, v in module._buffers.items():
        if v is not None:
            out[k] = v
    return out


def rebuild_tbe_metadata(wrapper: nn.Module, device: torch.device) -> Dict[str, torch.Tensor]:
    """Values of the wrapper's TBE tensors that fbgemm sets at construction, on ``device``.

    Returns:
        name -> real tensor for every TBE attribute that is meta in the wrapper's TBE
        and that a fresh fbgemm TBE built on ``device`` holds as a real tensor of the same
        shape and dtype (offsets, placements, counters, learning-rate tensor, ...).
        Floating-point storages (weights, optimizer state, caches) are absent: fresh
        construction put them on meta.
    """
    cls, args, kwargs = capture_tbe_args(wrapper, device)
    kwargs = dict(kwargs)
    if "device" in kwargs:
        kwargs["device"] = device
    with NoFloatAllocMode():
        fresh = cls(*args, **kwargs)
    from .upstream import kernel_module

    old = _named_tensors(kernel_module(wrapper))
    new = _named_tensors(fresh)
    out: Dict[str, torch.Tensor] = {}
    for name, t in old.items():
        if t.device.type != "meta":
            continue
        n = new.get(name)
        if n is None or n.device.type == "meta":
            continue
        if n.shape != t.shape or n.dtype != t.dtype:
            raise UnsupportedError(
                f"fbgemm TBE attribute {name!r}: rebuilt {tuple(n.shape)}/{n.dtype} differs "
                f"from the sharded model's {tuple(t.shape)}/{t.dtype}"
            )
        out[name] = n
    return out
