"""Init rules: where a tensor's initial value comes from when no checkpoint provides it.

One rule set for every model kind:

* ``init=`` (:func:`match_init`): an exact name wins, then the first fnmatch pattern in the
  mapping's order; the value is a distribution (fused, plan-invariant), a tensor (the global
  value; each rank copies its block) or a callable (an ordinary module's: applied to the
  whole tensor, each rank keeping its block; a TorchRec table's: to the local block).
* TorchRec tables: the table config's ``init_fn`` as a distribution when it is a known one
  (:func:`dist_from_init_fn`), else TorchRec's default U(+-sqrt(1/num_embeddings)).
* Ordinary modules (:func:`default_init`): ``reset_parameters()`` of common modules in
  closed form (nn.Linear, convolutions, nn.Embedding, norm layers, TorchRec's position
  weights, also where a rule names the ParameterDict holding them: :func:`container_init`),
  filled by the fused engine at global offsets (plan-invariant); anything else is ``RESET``:
  the module's own ``reset_parameters()`` (or ``_reset_parameters()``) is called under a
  per-module seed.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .spec import Constant, Dist, Normal, TruncatedNormal, Uniform, Zeros

__all__ = ["Default", "RESET", "UNCOVERED", "InitValue", "default_init", "container_init",
           "match_init", "check_init_map", "dist_from_init_fn", "default_table_dist",
           "reset_method", "fix_zero_row"]

#: What ``init=`` may map a name to.
InitValue = Union[Dist, torch.Tensor, Callable[[torch.Tensor], Any]]


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
    uncovered: bool = False  # the module's own reset_parameters() does not set this tensor


RESET = Default(reset=True)
#: A tensor of a known module class that its ``reset_parameters()`` leaves alone (an extra
#: parameter of a subclass): its value came from the constructor, which metamat cannot know.
UNCOVERED = Default(uncovered=True)


def check_init_map(init: Optional[Mapping[str, Any]]) -> Dict[str, InitValue]:
    """Validate ``init=``: str keys; values distributions, tensors or callables.

    Raises:
        TypeError: naming the bad entry.
    """
    if init is None:
        return {}
    if not isinstance(init, Mapping):
        raise TypeError(f"init must be a mapping of names/patterns to values, "
                        f"got {type(init).__name__}")
    for k, v in init.items():
        if not isinstance(k, str):
            raise TypeError(f"init keys must be names or fnmatch patterns, got {k!r}")
        if not (isinstance(v, (Dist, torch.Tensor)) or callable(v)):
            raise TypeError(f"init[{k!r}] must be a metamat distribution, a tensor or a "
                            f"callable, got {type(v).__name__}")
    return dict(init)


def match_init(init: Optional[Mapping[str, InitValue]], names: Sequence[str]
               ) -> Optional[InitValue]:
    """The ``init`` value for a tensor known by ``names`` (fqns, aliases, a table name).

    An exact name wins (earlier names first); then the first fnmatch pattern, in the
    mapping's order, that matches any name.
    """
    if not init:
        return None
    for n in names:
        if n in init:
            return init[n]
    for pattern, value in init.items():
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            return value
    return None


def reset_method(m: nn.Module) -> Optional[Callable[[], Any]]:
    """``m.reset_parameters`` or ``m._reset_parameters`` (bound), if it has one."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(m, name, None)
        if callable(fn):
            return fn
    return None


def _own(m: nn.Module, base: type) -> bool:
    """``m`` is a ``base`` whose ``reset_parameters`` is ``base``'s (not overridden); for a
    ``base`` initialised by its constructor alone (no reset method), exactly a ``base``."""
    if not isinstance(m, base):
        return False
    own = getattr(base, "reset_parameters", None)
    if own is None:
        return type(m) is base
    return getattr(type(m), "reset_parameters", None) is own


def _bound(fan_in: int) -> Optional[Dist]:
    # kaiming_uniform_(a=sqrt(5)) and the bias rule of nn.Linear/_ConvNd both give
    # U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    if fan_in <= 0:
        return None
    b = 1.0 / math.sqrt(fan_in)
    return Uniform(-b, b)


def _linear(m: nn.Linear, attr: str, shape: Tuple[int, ...]) -> Default:
    if attr not in ("weight", "bias"):
        return UNCOVERED
    d = _bound(int(m.in_features))
    return Default(dist=d) if d is not None else RESET


def _conv(m: nn.Module, attr: str, shape: Tuple[int, ...]) -> Default:
    # fan_in as torch.nn.init._calculate_fan_in_and_fan_out(weight): size(1) * kernel numel,
    # from the weight's global shape.
    if attr not in ("weight", "bias"):
        return UNCOVERED
    w = m.weight
    ws = tuple(w.shape)
    fan_in = ws[1] * math.prod(ws[2:]) if len(ws) >= 2 else 0
    d = _bound(int(fan_in))
    return Default(dist=d) if d is not None else RESET


def _embedding(m: nn.Embedding, attr: str, shape: Tuple[int, ...]) -> Default:
    if attr != "weight":
        return UNCOVERED
    return Default(dist=Normal(0.0, 1.0), zero_row=m.padding_idx)


def _affine_norm(m: nn.Module, attr: str, shape: Tuple[int, ...]) -> Default:
    if attr in ("weight", "running_var"):
        return Default(dist=Constant(1.0))
    if attr in ("bias", "running_mean", "num_batches_tracked"):
        return Default(dist=Zeros())
    return UNCOVERED


def _position_weights(m: nn.Module, attr: str, shape: Tuple[int, ...]) -> Default:
    # TorchRec's PositionWeightedModule(Collection).reset_parameters: fill_(1.0)
    if attr != "position_weight" and not attr.startswith("position_weights."):
        return UNCOVERED
    return Default(dist=Constant(1.0))


def _rules():
    rules = [(nn.Linear, _linear), (nn.Embedding, _embedding), (nn.LayerNorm, _affine_norm),
             (nn.modules.conv._ConvNd, _conv),
             (nn.modules.batchnorm._NormBase, _affine_norm),
             (nn.GroupNorm, _affine_norm)]
    if hasattr(nn, "RMSNorm"):
        rules.append((nn.RMSNorm, _affine_norm))
    return rules


def _xavier_normal_or_zeros(m: nn.Module, attr: str, shape: Tuple[int, ...]) -> Default:
    # TorchRec's cross networks (CrossNet, LowRankCrossNet, VectorCrossNet,
    # LowRankMixtureCrossNet): each kernel xavier_normal_ (gain 1), each bias zeros_, in the
    # constructor; fans as torch.nn.init._calculate_fan_in_and_fan_out
    if attr.startswith("bias."):
        return Default(dist=Zeros())
    if len(shape) < 2:
        return UNCOVERED
    receptive = math.prod(shape[2:])
    fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
    return Default(dist=Normal(0.0, math.sqrt(2.0 / (fan_in + fan_out))))


def _torchrec_rules() -> Optional[Tuple[list, list]]:
    """Rules for TorchRec's own dense modules: (module rules, container rules); None until
    torchrec is imported (a model cannot hold them before, and importing it here would cost
    every other model ~2 s)."""
    import sys

    if "torchrec" not in sys.modules:
        return None
    modules: list = []
    containers: list = []
    try:
        from torchrec.modules.feature_processor_ import (PositionWeightedModule,
                                                         PositionWeightedModuleCollection)
        modules.append((PositionWeightedModule, _position_weights))
        containers.append((PositionWeightedModuleCollection, "position_weights",
                           _position_weights))
    except ImportError:  # a TorchRec without feature processors
        pass
    try:
        from torchrec.modules import crossnet as cn
    except ImportError:  # a TorchRec without cross networks
        return modules, containers
    for cls, names in ((cn.CrossNet, ("kernels", "bias")),
                       (cn.LowRankCrossNet, ("W_kernels", "V_kernels", "bias")),
                       (cn.VectorCrossNet, ("kernels", "bias")),
                       (cn.LowRankMixtureCrossNet, ("U_kernels", "V_kernels", "C_kernels",
                                                    "bias"))):
        containers += [(cls, name, _xavier_normal_or_zeros) for name in names]
    return modules, containers


_RULES: Optional[list] = None
_TORCHREC_RULES: Optional[Tuple[list, list]] = None


def _torchrec() -> Tuple[list, list]:
    global _TORCHREC_RULES
    if _TORCHREC_RULES is None:
        _TORCHREC_RULES = _torchrec_rules()
    return _TORCHREC_RULES or ([], [])


def container_init(parent: nn.Module, container: str, attr: str,
                   shape: Tuple[int, ...]) -> Optional[Default]:
    """The fused equivalent of ``parent.reset_parameters()`` for ``parent.<container>[attr]``,
    a tensor of a ParameterDict/ParameterList child, where a rule names that container
    (TorchRec's PositionWeightedModuleCollection and its ``position_weights``); else None."""
    for base, name, rule in _torchrec()[1]:
        if name == container and _own(parent, base):
            return rule(parent, f"{container}.{attr}", shape)
    return None


def default_init(module: nn.Module, attr: str, shape: Tuple[int, ...]) -> Optional[Default]:
    """The fused equivalent of ``module.reset_parameters()`` for ``module.<attr>``.

    Args:
        module: the owning module.
        attr: the parameter/buffer name inside it.
        shape: its global shape.

    Returns:
        A :class:`Default` with a distribution, ``RESET`` when the module's own reset must
        run, or None when the module has no known rule.
    """
    global _RULES
    if _RULES is None:
        _RULES = _rules()
    for base, rule in _RULES + _torchrec()[0]:
        if _own(module, base):
            return rule(module, attr, shape)
    return None


def fix_zero_row(local: torch.Tensor, row: Optional[int], row_offset: int) -> None:
    """Zero global row ``row`` of a 2-D block starting at ``row_offset`` if it holds it."""
    if row is None or local.dim() != 2:
        return
    r = row - row_offset
    if 0 <= r < local.shape[0]:
        with torch.no_grad():
            local[r].zero_()



# ---------------------------------------------------------------------------------------------
# TorchRec tables


@functools.lru_cache(maxsize=64)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)  # ~60 µs


def _bind(fn: Callable, args: tuple, kwargs: dict) -> Dict[str, Any]:
    sig = _signature(fn)
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
    if type(init_fn) is functools.partial:
        # TorchRec gives every table its own partial, mostly of the same call: looked up by
        # the call (~0.3 µs) before any check (~1.5 µs)
        kw = init_fn.keywords
        try:
            return _PARTIAL_DISTS[(init_fn.func, init_fn.args, tuple(kw.items()) if kw else ())]
        except Exception:  # noqa: BLE001 - not seen yet, unhashable, a tensor's __eq__: the
            pass           # full path below answers
    fn, args, kwargs = init_fn, (), {}
    if isinstance(init_fn, functools.partial):
        fn, args, kwargs = init_fn.func, init_fn.args, dict(init_fn.keywords or {})
    if not all(type(v) in _PLAIN for v in (*args, *kwargs.values())):
        return _dist_of_call(fn, args, kwargs)  # a tensor, a generator: not cached
    # every table has its own partial; most are the same call (binding costs ~40 µs)
    dist = _dist_of_call_cached((fn, args, tuple(sorted(kwargs.items()))))
    if type(init_fn) is functools.partial and len(_PARTIAL_DISTS) < 4096:
        kw = init_fn.keywords
        _PARTIAL_DISTS[(init_fn.func, init_fn.args, tuple(kw.items()) if kw else ())] = dist
    return dist


_PLAIN = (int, float, bool, str, type(None))
# (func, args, keywords in their order) of a partial of plain values -> its distribution
_PARTIAL_DISTS: Dict[tuple, Optional[Dist]] = {}


@functools.lru_cache(maxsize=4096)
def _dist_of_call_cached(key: tuple) -> Optional[Dist]:
    fn, args, kwargs = key
    return _dist_of_call(fn, args, dict(kwargs))


def _dist_of_call(fn: Callable, args: tuple, kwargs: dict) -> Optional[Dist]:
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
