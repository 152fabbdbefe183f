"""Loads the compiled core ``metamat._C`` lazily, with a clear error when it is missing.

Importing metamat never imports the extension's CUDA parts nor initialises CUDA; the first
call that needs the core loads it, and a load failure says why and how to rebuild.
"""
from __future__ import annotations

import importlib

__all__ = ["core", "ExtensionNotBuiltError"]

_core = None
_error: BaseException | None = None

REBUILD_HINT = (
    "Rebuild it from the repository root with `make build` "
    "(or `python -m pip install --no-build-isolation -e .`)."
)


class ExtensionNotBuiltError(ImportError):
    """metamat's compiled core could not be loaded."""


def core():
    """Return the loaded ``metamat._C`` module, loading it on first use.

    Raises:
        ExtensionNotBuiltError: the module is missing or fails to load.
    """
    global _core, _error
    if _core is not None:
        return _core
    if _error is None:
        try:
            _core = importlib.import_module("metamat._C")
            return _core
        except ImportError as e:  # keep the reason; raise it on every call
            _error = e
    raise ExtensionNotBuiltError(
        f"metamat's compiled core (metamat._C) could not be loaded: {_error}. {REBUILD_HINT}"
    ) from _error
