"""Translate init callables (TorchRec ``init_fn``) and user ``init`` maps into distributions."""
from __future__ import annotations

import fnmatch
import functools
import inspect
import math
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from ..spec import Constant, Dist, Normal, TruncatedNormal, Uniform, Zeros

__all__ = ["dist_from_init_fn", "match_init", "default_table_dist"]


def _bind(fn: Callable, args: tuple, kwargs: dict) -> Dict[str, Any]:
    sig = inspect.signature(fn)
    bound = sig.bind_partial(None, *args, **kwargs)  # first parameter is the tensor
    bound.apply_defaults()
    out = dict(bound.arguments)
    out.pop(next(iter(sig.parameters)))
    return out


def dist_from_init_fn(init_fn: Any) -> Optional[Dist]:
    """Return the distribution an init callable draws from, or None if it is not one of
    ``functools.partial`` of ``torch.nn.init.{uniform_, normal_, trunc_normal_, constant_,
    zeros_}`` (or those functions themselves) with no generator argument.
    """
    fn, args, kwargs = init_fn, (), {}
    if isinstance(init_fn, functools.partial):
        fn, args, kwargs = init_fn.func, init_fn.args, dict(init_fn.keywords or {})
    known = {
        torch.nn.init.uniform_: "uniform",
        torch.nn.init.normal_: "normal",
        torch.nn.init.trunc_normal_: "trunc_normal",
        torch.nn.init.constant_: "constant",
        torch.nn.init.zeros_: "zeros",
    }
    kind = known.get(fn)
    if kind is None:
        return None
    try:
        p = _bind(fn, args, kwargs)
    except TypeError:
        return None
    if p.get("generator") is not None:
        return None
    if kind == "uniform":
        return Uniform(float(p["a"]), float(p["b"]))
    if kind == "normal":
        return Normal(float(p["mean"]), float(p["std"]))
    if kind == "trunc_normal":
        return TruncatedNormal(float(p["mean"]), float(p["std"]), float(p["a"]), float(p["b"]))
    if kind == "constant":
        return Zeros() if float(p["val"]) == 0.0 else Constant(float(p["val"]))
    return Zeros()


def default_table_dist(num_embeddings: int) -> Dist:
    """TorchRec's default table init: Uniform(-sqrt(1/n), +sqrt(1/n))."""
    bound = math.sqrt(1.0 / num_embeddings)
    return Uniform(-bound, bound)


def match_init(init: Optional[Mapping[str, Dist]], *names: str) -> Optional[Dist]:
    """First distribution in ``init`` whose fnmatch pattern matches any of ``names``.

    Exact names win over patterns; among patterns the mapping's order decides.
    """
    if not init:
        return None
    for name in names:
        if name in init:
            return init[name]
    for pattern, d in init.items():
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return d
    return None
