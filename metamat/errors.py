"""Named errors about the model and the ranks (checkpoint errors: :mod:`metamat.checkpoint`).

Every one of them is raised before the model is changed: a failed ``materialize`` leaves the
model as it was, on every rank (except :class:`PartialLoadError`, which says so).
"""
from __future__ import annotations

from typing import Iterable

from .checkpoint.errors import CheckpointError

__all__ = ["UnsupportedError", "UnsupportedDTensorError", "MissingValueError",
           "PeerFailedError", "PeerCheckpointError", "PartialLoadError", "DeviceMemoryError"]


class UnsupportedError(RuntimeError):
    """The model, kernel, placement or library version is outside what metamat handles
    (raised before anything is allocated)."""


class UnsupportedDTensorError(UnsupportedError):
    """A DTensor placement or layout metamat cannot materialize: Partial or _StridedShard
    placements, a rank outside the mesh."""


class MissingValueError(UnsupportedError):
    """Meta tensors whose value metamat cannot know: not in the checkpoint, no ``init=``
    entry, no rule for their module and no ``reset_parameters()`` that sets them (typically a
    non-persistent buffer such as a rotary embedding's ``inv_freq``).

    Attributes:
        names: the fqns, all of them.
    """

    def __init__(self, message: str, *, names: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.names = list(names)


class DeviceMemoryError(MemoryError):
    """The model's tensors do not fit in the device memory that is free (checked before
    anything is allocated; the message says what takes the memory, e.g. LXU caches)."""


class PeerFailedError(RuntimeError):
    """Another rank failed; this rank's model was left unchanged. The message names the
    failing rank(s), the stage and the first error."""


class PeerCheckpointError(CheckpointError, PeerFailedError):
    """Another rank failed with a :class:`metamat.CheckpointError` (so ``except
    CheckpointError`` catches the failure on every rank)."""


class PartialLoadError(RuntimeError):
    """A load with ``inplace=True`` failed after writing into the model's own tensors: the
    model is partly loaded. ``written`` lists the fqns whose bytes may have changed; the
    original error is ``__cause__``."""

    def __init__(self, message: str, *, written: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.written = list(written)
