"""Safety limits and guarded access for everything metamat reads as checkpoint *metadata*.

Metadata (safetensors headers, HF index json, checksum sidecars, DCP ``.metadata``,
torch.save ``data.pkl``) is untrusted input: each read here is bounded, so a hostile or
merely wrong file fails fast with a named error instead of hanging, exhausting memory or
recursing. Every limit can be raised by an environment variable (read at each check, so a
test or a long-running job can change it):

=============================  ===================================  ===========
limit                          environment variable                 default
=============================  ===================================  ===========
bytes of one metadata record   ``METAMAT_MAX_METADATA_BYTES``        1 GiB
objects a pickle expands to    ``METAMAT_MAX_PICKLE_OBJECTS``        10,000,000
nesting depth of a state dict  ``METAMAT_MAX_PICKLE_DEPTH``          200
nesting depth of JSON          ``METAMAT_MAX_JSON_DEPTH``            100
entries of one store listing   ``METAMAT_MAX_LIST_ENTRIES``          100,000
=============================  ===================================  ===========

Integers in JSON are bounded by Python's own digit limit (``PYTHONINTMAXSTRDIGITS``).

The guards every metadata open and every metadata-named path go through are in
:mod:`.access`.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .errors import InvalidHeaderError, LimitExceededError

__all__ = ["METADATA_BYTES", "PICKLE_OBJECTS", "PICKLE_DEPTH", "JSON_DEPTH", "LIST_ENTRIES",
           "limit", "check", "loads_json", "short_repr"]

# name -> (environment variable, default)
METADATA_BYTES = ("metadata bytes", "METAMAT_MAX_METADATA_BYTES", 1 << 30)
PICKLE_OBJECTS = ("pickle objects", "METAMAT_MAX_PICKLE_OBJECTS", 10_000_000)
# well below Python's recursion limit, so the walk over the state dict stays safe
PICKLE_DEPTH = ("pickle nesting depth", "METAMAT_MAX_PICKLE_DEPTH", 200)
# real metadata nests 2-4 levels; below every Python's json recursion limit
JSON_DEPTH = ("JSON nesting depth", "METAMAT_MAX_JSON_DEPTH", 100)
# objects listed under one s3:// prefix (an HF shard "directory"): a store whose listing never
# ends (every page truncated) is stopped here instead of filling memory
LIST_ENTRIES = ("listing entries", "METAMAT_MAX_LIST_ENTRIES", 100_000)


def limit(which) -> int:
    """The limit in force: its environment variable if set (a positive int), else the default."""
    _, env, default = which
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{env} must be a positive integer, got {raw!r}") from None
    if v <= 0:
        raise ValueError(f"{env} must be a positive integer, got {raw!r}")
    return v


def check(which, value: int, file=None, tensor=None, what: str = "") -> None:
    """Raise :class:`LimitExceededError` if ``value`` is above the limit ``which``."""
    m = limit(which)
    if value > m:
        name, env, _ = which
        raise LimitExceededError(
            f"{what or name}: {value} is above the limit of {m} ({name}); raise it with the "
            f"environment variable {env}=N", limit=name, value=value, maximum=m, env=env,
            file=file, tensor=tensor)


def loads_json(raw: bytes, what: str, file: str, object_pairs_hook=None,
               check_depth: bool = True) -> Any:
    """``json.loads`` with every failure as a named error.

    Nesting deeper than ``JSON_DEPTH`` is refused on every Python: 3.11's ``json`` raises
    ``RecursionError`` near 1,000 levels, 3.12's parses 5,000 (seen on the GPU host).
    ``check_depth=False`` is for a caller whose validation refuses any value nested deeper
    than its format allows (the safetensors header), where the walk would cost ~20% of the
    parse of a 100k-tensor header.

    Raises:
        InvalidHeaderError: not UTF-8, not JSON, or nested too deeply.
        LimitExceededError: an integer longer than Python's digit limit.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # say where, not which bytes
        raise InvalidHeaderError(f"{what} is not valid UTF-8 (at byte {e.start})",
                                 file=file) from None
    depth = limit(JSON_DEPTH)
    try:
        doc = json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as e:
        raise InvalidHeaderError(f"{what} is not valid JSON ({e.msg} at char {e.pos})",
                                 file=file) from None
    except RecursionError:
        raise _too_deep(what, depth, file) from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        if "digits" not in str(e):
            raise InvalidHeaderError(f"{what} is not valid JSON ({e})", file=file) from None
        import sys
        m = sys.get_int_max_str_digits()
        raise LimitExceededError(
            f"{what} holds an integer longer than {m} digits; raise the limit with the "
            "environment variable PYTHONINTMAXSTRDIGITS=N (or sys.set_int_max_str_digits)",
            limit="integer digits", maximum=m, env="PYTHONINTMAXSTRDIGITS",
            file=file) from None
    # openers bound the depth (those inside strings only add): most files need no walk
    if check_depth and raw.count(b"[") + raw.count(b"{") > depth and _deeper(doc, depth):
        raise _too_deep(what, depth, file)
    return doc


def _too_deep(what: str, depth: int, file: str) -> InvalidHeaderError:
    return InvalidHeaderError(f"{what} is nested more than {depth} levels deep (raise the limit "
                              f"with {JSON_DEPTH[1]}=N)", file=file)


def _deeper(doc: Any, depth: int) -> bool:
    """Whether parsed JSON nests dicts/lists more than ``depth`` levels (iterative)."""
    stack = [(doc, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        o, d = pop()
        t = type(o)
        if t is not dict and t is not list:
            continue
        if d > depth:
            return True
        for v in (o.values() if t is dict else o):
            if type(v) is dict or type(v) is list:
                push((v, d + 1))
    return False


def short_repr(x: Any, n: int = 80) -> str:
    """``repr`` of a str/int/float/bool/None cut to ``n`` characters; other objects by type
    name only (their repr could be huge, deep or self-referential)."""
    if isinstance(x, (str, bytes, int, float, bool, type(None))):
        if isinstance(x, int) and x.bit_length() > 256:
            return f"<int of {x.bit_length()} bits>"
        r = repr(x)
        return r if len(r) <= n else r[:n] + "..."
    return f"<{type(x).__name__}>"
