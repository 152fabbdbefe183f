"""Init distributions: plain data handed to the fill engine.

Each distribution is a frozen dataclass. The engine turns it into a numeric code plus
two/four float parameters (see ``as_params``); the value of element (r, c) of a table is a
pure function of (seed, table key, r, c, distribution), never of where the block lives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Dist", "Uniform", "Normal", "TruncatedNormal", "Constant", "Zeros"]

# Codes shared with csrc/include/metamat/fill.h (enum class DistKind). Keep in sync.
_UNIFORM, _NORMAL, _TRUNC_NORMAL, _CONSTANT = 0, 1, 2, 3


class Dist:
    """Base class of init distributions: :class:`Uniform`, :class:`Normal`,
    :class:`TruncatedNormal`, :class:`Constant`, :class:`Zeros`.

    A distribution is a frozen dataclass; its values are drawn by the fused engine
    (:func:`metamat.fill_`, ``materialize(init=...)``) as a pure function of the seed, the
    table name and the element's global position, bit-identical on every device.

    Example:
        >>> import metamat, torch
        >>> t = metamat.fill_(torch.empty(4, 8), metamat.Normal(0.0, 0.01), key="emb")
    """

    def as_params(self) -> tuple[int, float, float, float, float]:
        """Return (code, p0, p1, p2, p3) for the C++ core."""
        raise NotImplementedError


def _finite(name: str, **values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{name}: {k} must be a real number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise ValueError(f"{name}: {k} must be finite, got {v}")


@dataclass(frozen=True)
class Uniform(Dist):
    """Uniform on [a, b): value = a + u * (b - a), u a multiple of 2**-24 in [0, 1).

    Args:
        a: lower bound (included).
        b: upper bound (excluded); ``a < b``.

    Raises:
        TypeError: a bound is not a real number.
        ValueError: a bound is not finite, or ``a >= b``.
    """

    a: float = 0.0
    b: float = 1.0

    def __post_init__(self) -> None:
        _finite("Uniform", a=self.a, b=self.b)
        if not self.a < self.b:
            raise ValueError(f"Uniform: need a < b, got a={self.a}, b={self.b}")

    def as_params(self):
        """See :meth:`Dist.as_params`."""
        return (_UNIFORM, float(self.a), float(self.b), 0.0, 0.0)


@dataclass(frozen=True)
class Normal(Dist):
    """Normal(mean, std) by Box-Muller (std == 0 gives the constant mean).

    Args:
        mean: the mean.
        std: the standard deviation, ``>= 0``.

    Raises:
        TypeError: a parameter is not a real number.
        ValueError: a parameter is not finite, or ``std < 0``.
    """

    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        _finite("Normal", mean=self.mean, std=self.std)
        if self.std < 0:
            raise ValueError(f"Normal: std must be >= 0, got {self.std}")

    def as_params(self):
        """See :meth:`Dist.as_params`."""
        return (_NORMAL, float(self.mean), float(self.std), 0.0, 0.0)


@dataclass(frozen=True)
class TruncatedNormal(Dist):
    """Normal(mean, std) restricted to [a, b] by inverse CDF, as ``torch.nn.init.trunc_normal_``.

    Args:
        mean: the mean of the untruncated normal.
        std: its standard deviation, ``> 0``.
        a: lower bound of the values (absolute, as in ``trunc_normal_``).
        b: upper bound; ``a < b``.

    Raises:
        TypeError: a parameter is not a real number.
        ValueError: a parameter is not finite, ``std <= 0`` or ``a >= b``.
    """

    mean: float = 0.0
    std: float = 1.0
    a: float = -2.0
    b: float = 2.0

    def __post_init__(self) -> None:
        _finite("TruncatedNormal", mean=self.mean, std=self.std, a=self.a, b=self.b)
        if self.std <= 0:
            raise ValueError(f"TruncatedNormal: std must be > 0, got {self.std}")
        if not self.a < self.b:
            raise ValueError(f"TruncatedNormal: need a < b, got a={self.a}, b={self.b}")

    def as_params(self):
        """See :meth:`Dist.as_params`."""
        return (_TRUNC_NORMAL, float(self.mean), float(self.std), float(self.a), float(self.b))


@dataclass(frozen=True)
class Constant(Dist):
    """Every element equals ``value``.

    Args:
        value: the value (finite).

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is not finite.
    """

    value: float = 0.0

    def __post_init__(self) -> None:
        _finite("Constant", value=self.value)

    def as_params(self):
        """See :meth:`Dist.as_params`."""
        return (_CONSTANT, float(self.value), 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Zeros(Constant):
    """Every element is zero (``Constant(0.0)``; large CPU storages are born zero, so no
    write is needed).

    Raises:
        ValueError: a non-zero ``value`` was given.
    """

    value: float = 0.0

    def __post_init__(self) -> None:
        if self.value != 0.0:
            raise ValueError("Zeros takes no value; use Constant(value)")
