"""Restricted unpickling of every pickle metamat reads: DCP ``.metadata``, torch.save ``data.pkl``.

A pickle is a program. GLOBAL and STACK_GLOBAL import any name (``os.system``), REDUCE, NEWOBJ,
INST and OBJ call it, BUILD writes into whatever object is on the stack, a class or a function
included, for the rest of the process. metamat runs none of that on a checkpoint's say-so:

1. :func:`scan` walks the opcodes first, in C++ (``_C.pickle_scan``): bytes that are not a
   pickle are an :class:`InvalidHeaderError`; a memo index far past the entries written (a
   10-byte pickle that makes CPython allocate and zero gigabytes), an extension-registry code
   (resolved through copyreg's process-wide cache, past ``find_class``) or a persistent id
   the format does not use is an :class:`UnsafePickleError`, before anything is unpickled.
2. ``find_class`` resolves only an allow-list. What it hands out cannot be changed by a BUILD:
   functions are slot-less :class:`Call` wrappers whose ``__setstate__`` refuses; classes are
   *sealed* subclasses (a metaclass refuses ``setattr``; their instances, fresh per load, take
   state as usual); dtypes and layouts are immutable C objects. Anything else is an
   :class:`UnsafePickleError` naming the global.

For DCP ``.metadata`` the allow-list is what ``torch.distributed.checkpoint`` pickles (read off
real checkpoints with dense tensors, ShardedTensor and DTensor chunks, bytes and object entries,
both serializations, torch 2.13): the ``metadata`` dataclasses, the filesystem's ``_StorageInfo``,
``torch.Size``, dtypes, the layout helper, the memory-format enum, ``pathlib`` paths (a
``checkpoint_id`` given as a ``Path``) and builtin containers. Names are looked up in the torch
that runs; one it lacks (an older torch) is simply not allowed.

``trust_pickles=True`` (:func:`metamat.open_checkpoint`) is the opt-out for a checkpoint you
trust that holds custom classes: plain ``pickle`` semantics, as ``torch.load(weights_only=False)``
or torch's own ``dcp.load``; the opcode walk still runs.
"""
from __future__ import annotations

import collections
import io
import pathlib
import pickle
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .errors import InvalidHeaderError, UnsafePickleError
from .limits import short_repr

__all__ = ["Call", "scan", "refuse", "sealed", "load_dcp_metadata", "TRUST_HINT"]

TRUST_HINT = ("If you trust this checkpoint: metamat.open_checkpoint(path, trust_pickles=True) "
              "or --trust-pickles on the command line.")


def scan(data, where: Optional[str], what: str, persistent_ids: bool = False) -> None:
    """Walk the opcodes of the pickle ``data`` (a bytes-like object) without running it.

    Raises:
        InvalidHeaderError: the bytes are not a pickle (unknown opcode, truncated).
        UnsafePickleError: a memo-index bomb, an extension code, a persistent id where
            ``persistent_ids`` is False, an out-of-band buffer.
    """
    from .._ext import core
    why, refused = core().pickle_scan(data, persistent_ids)
    if not why:
        return
    if refused:
        raise UnsafePickleError(f"{what} is refused before unpickling: {why}", file=where)
    raise InvalidHeaderError(f"{what} does not unpickle ({why})", file=where)


def refuse(what: str, module: Any, name: Any, where: Optional[str]) -> UnsafePickleError:
    """The error for a global outside the allow-list."""
    g = f"{short_repr(module)}.{short_repr(name)}".replace("'", "")
    return UnsafePickleError(f"{what} names the global {g}, which is not on metamat's "
                             f"allow-list for it; nothing it names was called. {TRUST_HINT}",
                             name=g, file=where)


def _no_build(self, state) -> None:
    raise UnsafePickleError(f"the pickle sets the state of {type(self).__name__} (a BUILD on "
                            "a function, class or shared object of the allow-list)")


class Call:
    """An allow-listed callable as a pickle sees it: calling it calls ``fn``; a BUILD on it
    (which on a plain function could rewrite ``__defaults__`` for every later load) raises."""

    __slots__ = ("_fn", "_name")

    def __init__(self, fn: Callable, name: str) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __setattr__(self, k, v) -> None:
        raise UnsafePickleError(f"the pickle sets attribute {short_repr(k)} of {self._name}")

    __setstate__ = _no_build

    def __repr__(self) -> str:
        return f"<allow-listed {self._name}>"


class _SealedMeta(type):
    """Metaclass of the sealed classes: no attribute of the class itself can be set."""

    def __setattr__(cls, k, v) -> None:
        raise UnsafePickleError(f"the pickle sets attribute {short_repr(k)} of class "
                                f"{cls.__name__} (a BUILD on a class)")

    def __delattr__(cls, k) -> None:
        raise UnsafePickleError(f"the pickle deletes attribute {short_repr(k)} of class "
                                f"{cls.__name__}")


def sealed(cls: type, namespace: Optional[Dict[str, Any]] = None) -> type:
    """A subclass of ``cls`` whose class attributes cannot be set (``isinstance`` still holds);
    instances take pickle state as ``cls``'s do. ``cls`` must have the plain ``type`` metaclass.
    """
    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__slots__": (),
          **(namespace or {})}
    return _SealedMeta(cls.__name__, (cls,), ns)


# --- DCP .metadata ------------------------------------------------------------------------

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # torch < 2.1 kept TensorProperties with ShardedTensor's metadata
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties",),
}
# the memory-format enums TensorProperties pickles (value -> memory format, decoded below)
_MEM_FORMAT_ENUMS = {("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                     ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING")}
_PATHS = ("PosixPath", "PurePosixPath", "Path", "PurePath", "WindowsPath", "PureWindowsPath")


class _MemFormat:
    """A memory-format enum member as the pickle gave it (a fresh object: a BUILD on the real,
    shared enum member would change it for the whole process)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        object.__setattr__(self, "value", value)

    def __setattr__(self, k, v) -> None:
        raise UnsafePickleError("the pickle sets an attribute of a memory-format enum member")

    __setstate__ = _no_build


def _memory_format(enc: Any) -> torch.memory_format:
    value = enc.value if isinstance(enc, _MemFormat) else enc
    fmt = {0: torch.contiguous_format, 1: torch.channels_last,
           2: torch.preserve_format}.get(value) if type(value) is int else None
    if fmt is None:
        raise InvalidHeaderError(f"memory format encoding {short_repr(value)} is not one DCP "
                                 "writes")
    return fmt


def _tensor_properties_setstate(self, state) -> None:
    """``TensorProperties.__setstate__`` without the shared enum member (see _MemFormat)."""
    if isinstance(state, dict):  # torch < 2.0 pickled the dataclass fields
        self.__dict__.update(state)
        return
    if not isinstance(state, tuple) or len(state) != 5:
        raise InvalidHeaderError(f"TensorProperties state is {type(state).__name__}, not the "
                                 "5-tuple DCP writes")
    self.dtype, self.layout, self.requires_grad, enc, self.pin_memory = state
    self.memory_format = _memory_format(enc)


def _layout(name: Any) -> torch.layout:
    v = getattr(torch, name[len("torch."):], None) if isinstance(name, str) \
        and name.startswith("torch.") else None
    if not isinstance(v, torch.layout):
        raise InvalidHeaderError(f"layout {short_repr(name)} is not a torch layout")
    return v


def _path(windows: bool) -> Callable:
    cls = pathlib.PureWindowsPath if windows else pathlib.PurePosixPath

    def make(*parts):
        if not all(isinstance(p, str) for p in parts):
            raise InvalidHeaderError("a path built from something other than strings")
        return cls(*parts)
    return make


_dcp_globals: Optional[Dict[Tuple[str, str], Any]] = None


def _dcp_allow_list() -> Dict[Tuple[str, str], Any]:
    """(module, name) -> what ``find_class`` returns, for the torch that runs (built once)."""
    global _dcp_globals
    if _dcp_globals is not None:
        return _dcp_globals
    import importlib
    out: Dict[Tuple[str, str], Any] = {}
    for mod, names in _DCP_CLASSES.items():
        try:
            m = importlib.import_module(mod)
        except ImportError:  # not in this torch
            continue
        for n in names:
            cls = getattr(m, n, None)
            if isinstance(cls, type) and type(cls) is type:
                ns = {"__setstate__": _tensor_properties_setstate} \
                    if n == "TensorProperties" else None
                out[(mod, n)] = sealed(cls, ns)
    for key in _MEM_FORMAT_ENUMS:
        out[key] = Call(_MemFormat, f"{key[0]}.{key[1]}")
    # an immutable C type (a BUILD on it fails) that takes only ints: as is, it is hot
    out[("torch", "Size")] = torch.Size
    out[("torch.serialization", "_get_layout")] = Call(_layout, "torch.serialization._get_layout")
    for mod in ("pathlib", "pathlib._local"):  # Python 3.13 pickles pathlib._local.PosixPath
        for n in _PATHS:
            out[(mod, n)] = Call(_path("Windows" in n), f"pathlib.{n}")
    for n, fn in (("dict", dict), ("list", list), ("tuple", tuple), ("set", set),
                  ("frozenset", frozenset)):
        out[("builtins", n)] = Call(fn, n)
    out[("collections", "OrderedDict")] = Call(collections.OrderedDict, "OrderedDict")
    _dcp_globals = out
    return out


class _DCPUnpickler(pickle.Unpickler):
    def __init__(self, f, where: str) -> None:
        super().__init__(f)
        self._where = where
        self._allowed = _dcp_allow_list()

    def find_class(self, module: str, name: str) -> Any:
        got = self._allowed.get((module, name))
        if got is not None:
            return got
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # an immutable C object: BUILD cannot change it
        raise refuse("DCP .metadata", module, name, self._where)


def load_dcp_metadata(raw: bytes, where: str, trust_pickles: bool = False):
    """Unpickle the bytes of a DCP ``.metadata`` file (see the module docstring).

    Returns:
        What the pickle holds (the caller checks it is a ``Metadata``).

    Raises:
        UnsafePickleError: a global outside the allow-list, a BUILD on a class or shared
            object, a memory bomb, an extension code or persistent id (not with
            ``trust_pickles``, except the memory bomb and extension code, refused always).
        InvalidHeaderError: not a pickle, or one that fails to load.
    """
    scan(raw, where, "DCP .metadata", persistent_ids=trust_pickles)
    up = pickle.Unpickler(io.BytesIO(raw)) if trust_pickles else _DCPUnpickler(
        io.BytesIO(raw), where)
    try:
        return up.load()
    except UnsafePickleError as e:
        if e.file is None:
            raise UnsafePickleError(e.detail, name=e.name, file=where) from None
        raise
    except InvalidHeaderError as e:
        if e.file is None:
            raise InvalidHeaderError(e.detail, file=where) from None
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise InvalidHeaderError(f"cannot read .metadata ({type(e).__name__}: "
                                 f"{short_repr(str(e), 200)})", file=where) from None
