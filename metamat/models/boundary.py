"""The machinery behind metamat's doors to upstream internals.

metamat reads private attributes of torch, TorchRec and fbgemm objects and, while it builds a
model, replaces a few of their names. Each upstream library has one door that declares every
such name once, as data (:class:`Private`), with the versions it was checked on:
:mod:`metamat.models.torch_upstream` (torch) and :mod:`metamat.models.torchrec.upstream`
(TorchRec and fbgemm). Callers use the doors' accessors, never ``getattr(x, "_private",
default)``. This module gives the doors:

* :class:`Boundary`: the declarations of one library and their checks. :meth:`Boundary.require`
  checks every module-level and class-level name of a group (modules, classes, functions,
  methods, patch sites) and raises :class:`~metamat.errors.UnsupportedError` naming each one
  that is missing or of another kind; :meth:`Boundary.check_instance` checks the declared
  instance attributes of an object's classes. Both run before anything is allocated: a door
  calls ``require`` at the first use of its group (``shard_on_meta``, planning), and the
  adapters check each upstream object they will read when they find it (planning), not when
  they read it (which may be after allocation). Instance attributes are checked on instances,
  not from the classes' sources: fbgemm sets most of its attributes through ``setattr`` with
  computed names, which no source scan sees. A type whose instance passed is not checked
  again (the attributes are set by constructors: a renamed one is missing from every instance).
* :func:`patch` / :class:`Patch`: the one registry of replacements. A patch names a declared
  patch site (``Private(..., patched=True)``), records what it replaced (or that nothing was
  there) and puts it back on every exit path; :func:`active_patches` lists the ones in force
  and :func:`patch_sites` every declared site (tests/test_upstream.py checks each is undone).

Nothing here imports an upstream library: a declaration is resolved when it is checked.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import UnsupportedError

__all__ = ["Private", "Boundary", "Patch", "patch", "apply_patch", "active_patches",
           "patch_sites", "boundaries", "MISSING"]

#: What a declared name is. ``attr``: an instance attribute (checked on instances);
#: ``class_attr``: an attribute of the class itself; ``method``: a callable of the class (found
#: through its bases); ``own_method``: a callable the class defines itself (in its
#: ``__dict__``: patched there); ``function``: a callable of a module (not a class);
#: ``class``: a class of a module; ``object``: any attribute of a module or namespace.
KINDS = ("attr", "class_attr", "method", "own_method", "function", "class", "object")


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()  # what a patch found where nothing was


@dataclasses.dataclass(frozen=True)
class Private:
    """One upstream name metamat uses: ``owner`` (a dotted module path, optionally followed by
    class names: ``"torchrec.distributed.embeddingbag.ShardedEmbeddingBagCollection"``, or a
    ``torch.ops`` namespace) and ``name`` of the given ``kind`` (:data:`KINDS`).

    Attributes:
        checked: the library versions it was checked on (present, of this kind).
        why: what metamat does with it.
        group: the door's group whose first use checks it (``Boundary.require(group)``).
        patched: metamat replaces it while it builds a model (a patch site; ``patch()`` refuses
            any other name).
        optional: empty for a required name; else why it may be absent and what the accessor
            answers then (e.g. a buffer TorchRec registers at the first forward). Optional names
            are not checked; their accessors are the only place that handles their absence.
    """

    owner: str
    name: str
    kind: str
    checked: Tuple[str, ...]
    why: str = ""
    group: str = "default"
    patched: bool = False
    optional: str = ""
    library: str = ""  # how messages name the versions' library (default: owner's package)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Private {self.qualname}: kind {self.kind!r} not in {KINDS}")

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.name}"

    def describe(self) -> str:
        kind = {"attr": "instance attribute", "class_attr": "class attribute",
                "own_method": "method"}.get(self.kind, self.kind)
        lib = self.library or self.owner.split(".")[0]
        return f"{self.qualname} ({kind}; checked on {lib} {', '.join(self.checked)})"


_split_cache: Dict[str, Tuple[str, Tuple[str, ...]]] = {}


def resolve(owner: str) -> Any:
    """The object named by a dotted ``owner``: the longest importable module prefix, then
    attributes. Raises ImportError / AttributeError."""
    split = _split_cache.get(owner)
    if split is not None:
        mod, rest = split
        obj: Any = importlib.import_module(mod)
    else:
        parts = owner.split(".")
        obj = None
        for i in range(len(parts), 0, -1):
            mod = ".".join(parts[:i])
            m = sys.modules.get(mod)
            if m is None:
                try:
                    m = importlib.import_module(mod)
                except ModuleNotFoundError as e:
                    if e.name is not None and mod != e.name and not mod.startswith(e.name + "."):
                        raise  # the module exists and one of its own imports is missing
                    continue
            if isinstance(m, types.ModuleType):
                obj, rest = m, tuple(parts[i:])
                break
        if obj is None:
            raise ImportError(f"no module in {owner!r}")
        _split_cache[owner] = (mod, rest)
    for name in rest:
        obj = getattr(obj, name)
    return obj


def _kind_ok(kind: str, owner: Any, name: str) -> Optional[str]:
    """None when ``owner`` has ``name`` of ``kind`` (not ``attr``), else what is wrong."""
    if kind == "own_method":
        if not isinstance(owner, type):
            return "owner is not a class"
        if name not in owner.__dict__:
            return "missing" if not hasattr(owner, name) else "not defined by the class itself"
        return None if callable(getattr(owner, name)) else "not callable"
    try:
        value = getattr(owner, name)
    except AttributeError:
        return "missing"
    except RuntimeError:  # torch.ops namespaces raise this for an unknown op
        return "missing"
    if kind == "class":
        return None if isinstance(value, type) else f"not a class ({type(value).__name__})"
    if kind == "function":
        return None if callable(value) and not isinstance(value, type) \
            else f"not a function ({type(value).__name__})"
    if kind == "method":
        if not isinstance(owner, type):
            return "owner is not a class"
        return None if callable(value) else f"not callable ({type(value).__name__})"
    if kind == "class_attr":
        return None if isinstance(owner, type) else "owner is not a class"
    return None  # object


class Boundary:
    """The declared private names of one upstream library (module docstring).

    Args:
        library: how messages name it (``"torchrec/fbgemm_gpu"``).
        versions: returns the installed versions, for messages (``"torchrec 1.8.0, ..."``).
    """

    def __init__(self, library: str, versions: Callable[[], str]) -> None:
        self.library = library
        self._versions = versions
        self.declared: List[Private] = []
        self._by_key: Dict[Tuple[str, str], Private] = {}
        self._attrs_of: Dict[str, List[Private]] = {}  # owner -> its instance attributes
        self._seen: Dict[type, bool] = {}  # types whose instances passed check_instance
        self._passed: Dict[Optional[str], bool] = {}  # groups whose require() passed
        self._factories: Dict[str, Callable[[], Any]] = {}
        #: (patch site, why) of each time a patch found its target present but not the one it
        #: was checked against (e.g. another signature) and left it alone: the upstream code
        #: ran unpatched, with the same result (the patches that do so are speed-ups only)
        self.left_alone: List[Tuple[Private, str]] = []
        _BOUNDARIES.append(self)

    def declare(self, *privates: Private) -> None:
        for p in privates:
            key = (p.owner, p.name)
            if key in self._by_key:
                raise ValueError(f"{p.qualname} declared twice")
            self._by_key[key] = p
            self.declared.append(p)
            if p.kind == "attr":
                self._attrs_of.setdefault(p.owner, []).append(p)

    def instance_factory(self, owner: str, make: Callable[[], Any]) -> None:
        """``make()`` builds a cheap instance of class ``owner``: its declared instance
        attributes are then checked by :meth:`require` too (``nn.Module()``, a placement)."""
        self._factories[owner] = make

    def get_declared(self, owner: str, name: str) -> Private:
        """The declaration of ``owner.name`` (KeyError: undeclared)."""
        return self._by_key[(owner, name)]

    def versions(self) -> str:
        try:
            return self._versions()
        except Exception:  # noqa: BLE001 - only for messages
            return "unknown versions"

    def error(self, problems: Sequence[Tuple[Private, str]]) -> UnsupportedError:
        lines = "; ".join(f"{p.describe()}: {what}" for p, what in problems)
        return UnsupportedError(
            f"metamat needs {self.library} internals that the installed {self.versions()} "
            f"lacks (nothing was allocated): {lines}")

    # -- checks ---------------------------------------------------------------------------

    def problems(self, group: Optional[str] = None) -> List[Tuple[Private, str]]:
        """(declaration, what is wrong) of every required module- or class-level name of
        ``group`` (all groups: None) that is missing or of another kind."""
        out: List[Tuple[Private, str]] = []
        made_by: Dict[str, Any] = {}
        for p in self.declared:
            if p.optional or (group is not None and p.group != group):
                continue
            try:
                owner = resolve(p.owner)
            except (ImportError, AttributeError, RuntimeError) as e:
                out.append((p, f"its owner {p.owner} is missing ({e})"))
                continue
            if p.kind == "attr":
                if not isinstance(owner, type):
                    out.append((p, f"its owner {p.owner} is not a class"))
                elif p.owner in self._factories:
                    made = made_by.get(p.owner)
                    if made is None:
                        made = made_by[p.owner] = self._factories[p.owner]()
                    if not _has(made, p.name):
                        out.append((p, "missing on an instance"))
                continue  # else checked on the instances the adapters find
            live = _active_site(p) if p.patched else None
            if live is not None and live.original is not MISSING:
                # metamat's own patch is in force (a nested call): check what it replaced
                what = _kind_ok(p.kind, _Holder(p.name, live.original), p.name) \
                    if p.kind not in ("own_method", "method", "class_attr") else None
            else:
                what = _kind_ok(p.kind, owner, p.name)
            if what is not None:
                out.append((p, what))
        return out

    def require(self, group: Optional[str] = None) -> None:
        """Check every required module/class-level name of ``group`` (all: None) at its first
        use in this process (module docstring); a group that passed is not checked again.

        Raises:
            UnsupportedError: naming every missing one (nothing was allocated).
        """
        if self._passed.get(group):
            return
        bad = self.problems(group)
        if bad:
            raise self.error(bad)
        self._passed[group] = True

    def instance_attrs(self, cls: type) -> List[Private]:
        """The required instance attributes declared for ``cls`` and its bases."""
        out: List[Private] = []
        for c in cls.__mro__:
            ps = self._attrs_of.get(f"{c.__module__}.{c.__qualname__}")
            if ps:
                out.extend(p for p in ps if not p.optional)
        return out

    def check_instance(self, obj: Any) -> Any:
        """Check that ``obj`` has every instance attribute declared for its classes (once per
        type). Returns ``obj``.

        Raises:
            UnsupportedError: naming every missing one.
        """
        cls = type(obj)
        if self._seen.get(cls):
            return obj
        missing = [(p, "missing on the instance") for p in self.instance_attrs(cls)
                   if not _has(obj, p.name)]
        if missing:
            raise self.error(missing)
        self._seen[cls] = True
        return obj

    def forget(self) -> None:
        """Check every group again at its next use, every type at its next instance (tests)."""
        self._seen.clear()
        self._passed.clear()

    def read(self, obj: Any, owner: str, name: str) -> Any:
        """``obj.<name>``, declared as ``owner.name``; an UnsupportedError naming it if absent
        (never a default)."""
        try:
            return getattr(obj, name)
        except AttributeError:
            raise self.error([(self.get_declared(owner, name),
                               f"missing on a {type(obj).__name__}")]) from None

    def note_left_alone(self, site: Private, why: str) -> None:
        """Record that a patch left ``site`` alone (see :attr:`left_alone`); kept once."""
        entry = (site, why)
        if entry not in self.left_alone:
            self.left_alone.append(entry)

    def sites(self) -> List[Private]:
        return [p for p in self.declared if p.patched]


def _has(obj: Any, name: str) -> bool:
    try:
        object.__getattribute__(obj, "__dict__")
    except AttributeError:
        pass
    else:
        if name in obj.__dict__:
            return True
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True


class _Holder:
    """Stands for the owner of a name whose value is known (what a live patch replaced)."""

    def __init__(self, name: str, value: Any) -> None:
        setattr(self, name, value)


def _active_site(site: Private) -> Optional["Patch"]:
    with _ACTIVE_LOCK:
        for p in _ACTIVE:
            if p.site == site:
                return p
    return None


_BOUNDARIES: List[Boundary] = []


def boundaries() -> List[Boundary]:
    """Every door created so far (importing a door creates it)."""
    return list(_BOUNDARIES)


def patch_sites() -> List[Private]:
    """Every declared patch site of every door imported (importing
    :mod:`metamat.models.torch_upstream` and :mod:`metamat.models.torchrec.upstream` imports
    no upstream library)."""
    return [p for b in _BOUNDARIES for p in b.sites()]


# -- patches -------------------------------------------------------------------------------

_ACTIVE: List["Patch"] = []
_ACTIVE_LOCK = threading.Lock()


class Patch:
    """One replacement in force: ``site`` (a declared patch site) on ``target`` (the resolved
    owner) replaced by ``new``; ``original`` is what was there (:data:`MISSING`: nothing, the
    attribute was added)."""

    __slots__ = ("site", "target", "new", "original", "keep_foreign", "done")

    def __init__(self, site: Private, target: Any, new: Any, original: Any,
                 keep_foreign: bool) -> None:
        self.site, self.target, self.new, self.original = site, target, new, original
        self.keep_foreign = keep_foreign
        self.done = False

    def current(self) -> Any:
        if isinstance(self.target, type):
            return self.target.__dict__.get(self.site.name, MISSING)
        return getattr(self.target, self.site.name, MISSING)

    def undo(self) -> None:
        """Put the original back (delete the attribute when there was none). With
        ``keep_foreign``, a replacement someone else made meanwhile is kept. Runs once."""
        if self.done:
            return
        self.done = True
        try:
            if not (self.keep_foreign and self.current() is not self.new):
                if self.original is MISSING:
                    if self.current() is not MISSING:
                        delattr(self.target, self.site.name)
                else:
                    setattr(self.target, self.site.name, self.original)
        finally:
            with _ACTIVE_LOCK:
                try:
                    _ACTIVE.remove(self)
                except ValueError:
                    pass

    def __repr__(self) -> str:
        return f"<Patch {self.site.qualname}{' (undone)' if self.done else ''}>"


def apply_patch(site: Private, new: Any, *, keep_foreign: bool = False) -> Patch:
    """Replace declared patch site ``site`` by ``new`` and return the :class:`Patch` (the
    caller undoes it: prefer :func:`patch`). The original is read from the class's own
    ``__dict__`` for a class (an inherited method is deleted again, not copied down).

    Raises:
        ValueError: ``site`` is not a declared patch site.
        UnsupportedError: its owner is missing.
    """
    if not site.patched or not any(site in b.sites() for b in _BOUNDARIES):
        raise ValueError(f"{site.qualname} is not a declared patch site")
    try:
        target = resolve(site.owner)
    except (ImportError, AttributeError, RuntimeError) as e:
        raise UnsupportedError(f"patch site {site.qualname}: owner missing ({e})") from e
    if isinstance(target, type):
        original = target.__dict__.get(site.name, MISSING)
    else:
        original = getattr(target, site.name, MISSING)
    p = Patch(site, target, new, original, keep_foreign)
    with _ACTIVE_LOCK:
        _ACTIVE.append(p)
    try:
        setattr(target, site.name, new)
    except BaseException:
        p.done = True
        with _ACTIVE_LOCK:
            _ACTIVE.remove(p)
        raise
    return p


@contextlib.contextmanager
def patch(site: Private, new: Any, *, keep_foreign: bool = False) -> Iterator[Patch]:
    """While active, declared patch site ``site`` is ``new``; the original is back on every
    exit path (an exception, a generator closed early)."""
    p = apply_patch(site, new, keep_foreign=keep_foreign)
    try:
        yield p
    finally:
        p.undo()


def active_patches() -> List[Patch]:
    """The patches in force now (any thread)."""
    with _ACTIVE_LOCK:
        return list(_ACTIVE)
