"""Named errors of the DTensor path."""
from __future__ import annotations

from ..checkpoint.errors import CheckpointError

__all__ = ["UnsupportedDTensorError", "PeerFailedError", "PeerCheckpointError"]


class UnsupportedDTensorError(RuntimeError):
    """A placement, module or tensor layout metamat cannot materialize (raised before anything
    is allocated): Partial or _StridedShard placements, a rank outside the mesh, a parameter
    with no expressible init and no ``reset_parameters()``."""


class PeerFailedError(RuntimeError):
    """Another rank failed to materialize its shards; this rank's model was left unchanged.
    The message names the failing rank(s) and the first error."""


class PeerCheckpointError(CheckpointError, PeerFailedError):
    """Another rank failed with a :class:`metamat.CheckpointError` (so ``except
    CheckpointError`` catches the failure on every rank)."""
