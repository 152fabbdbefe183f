"""Init semantics: ``reset_parameters()`` of common modules as fused distributions.

For the modules below the distribution of each parameter/buffer is known in closed form, so
the fused engine fills it at its global offsets (plan-invariant). Anything else returns
``RESET``: the caller calls the module's own ``reset_parameters()`` after materializing it.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..spec import Constant, Dist, Normal, Uniform, Zeros

__all__ = ["Default", "RESET", "default_init", "match_init"]


@dataclass(frozen=True)
class Default:
    """How a tensor is initialised when nothing names it.

    Attributes:
        dist: the fused distribution (None with ``reset``).
        zero_row: a global row to zero afterwards (``nn.Embedding.padding_idx``).
        reset: the value comes from the module's ``reset_parameters()``.
    """

    dist: Optional[Dist] = None
    zero_row: Optional[int] = None
    reset: bool = False


RESET = Default(reset=True)


def match_init(init: Optional[Mapping[str, Dist]], names: Sequence[str]) -> Optional[Dist]:
    """The distribution of the first ``init`` pattern (fnmatch) matching any of ``names``."""
    if not init:
        return None
    for pattern, dist in init.items():
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            if not isinstance(dist, Dist):
                raise TypeError(f"init[{pattern!r}] must be a metamat distribution, "
                                f"got {type(dist).__name__}")
            return dist
    return None


def _own(m: nn.Module, base: type) -> bool:
    """``m`` is a ``base`` whose ``reset_parameters`` is ``base``'s (not overridden)."""
    return isinstance(m, base) and type(m).reset_parameters is base.reset_parameters


def _bound(fan_in: int) -> Optional[Dist]:
    # kaiming_uniform_(a=sqrt(5)) and the bias rule of nn.Linear/_ConvNd both give
    # U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    if fan_in <= 0:
        return None
    b = 1.0 / math.sqrt(fan_in)
    return Uniform(-b, b)


def _linear(m: nn.Linear, attr: str, shape: Tuple[int, ...]) -> Default:
    d = _bound(int(m.in_features))
    return Default(dist=d) if d is not None else RESET


def _conv(m: nn.Module, attr: str, shape: Tuple[int, ...]) -> Default:
    # fan_in as torch.nn.init._calculate_fan_in_and_fan_out(weight): size(1) * kernel numel,
    # from the weight's global shape.
    w = m.weight
    ws = tuple(w.shape)
    fan_in = ws[1] * math.prod(ws[2:]) if len(ws) >= 2 else 0
    d = _bound(int(fan_in))
    return Default(dist=d) if d is not None else RESET


def _embedding(m: nn.Embedding, attr: str, shape: Tuple[int, ...]) -> Default:
    return Default(dist=Normal(0.0, 1.0), zero_row=m.padding_idx)


def _affine_norm(m: nn.Module, attr: str, shape: Tuple[int, ...]) -> Default:
    if attr in ("weight", "running_var"):
        return Default(dist=Constant(1.0))
    if attr in ("bias", "running_mean", "num_batches_tracked"):
        return Default(dist=Zeros())
    return RESET


def _rules():
    rules = [(nn.Linear, _linear), (nn.Embedding, _embedding), (nn.LayerNorm, _affine_norm),
             (nn.modules.conv._ConvNd, _conv),
             (nn.modules.batchnorm._NormBase, _affine_norm),
             (nn.GroupNorm, _affine_norm)]
    if hasattr(nn, "RMSNorm"):
        rules.append((nn.RMSNorm, _affine_norm))
    return rules


_RULES: Optional[list] = None


def default_init(module: nn.Module, attr: str, shape: Tuple[int, ...], is_param: bool,
                 has_reset: bool) -> Default:
    """The fused equivalent of ``module.reset_parameters()`` for ``module.<attr>``.

    Args:
        module: the owning module.
        attr: the parameter/buffer name inside it.
        shape: its global shape.
        is_param: a parameter (else a buffer).
        has_reset: ``module`` has a callable ``reset_parameters``.

    Returns:
        A :class:`Default`: a distribution, or ``RESET`` (call ``reset_parameters()``), or for a
        buffer of a module without a rule and without ``reset_parameters`` zeros.
    """
    global _RULES
    if _RULES is None:
        _RULES = _rules()
    for base, rule in _RULES:
        if _own(module, base):
            return rule(module, attr, shape)
    if not is_param and not has_reset:
        return Default(dist=Zeros())
    return RESET


def fix_zero_row(local: torch.Tensor, row: Optional[int], row_offset: int) -> None:
    """Zero global row ``row`` of a 2-D block starting at ``row_offset`` if it holds it."""
    if row is None or local.dim() != 2:
        return
    r = row - row_offset
    if 0 <= r < local.shape[0]:
        with torch.no_grad():
            local[r].zero_()

