"""DTensor support: models split on meta by TP (``parallelize_module``) or FSDP2 (``fully_shard``).

plan (walk.py) -> allocate / fill (fill.py: engine or checkpoint) -> agree + swap
(register.py); ``materialize_dtensor`` (materialize.py) runs them. ``has_dtensor(model)`` is
the dispatch predicate for ``metamat.materialize``.
"""
from .errors import PeerCheckpointError, PeerFailedError, UnsupportedDTensorError
from .materialize import materialize_dtensor
from .walk import has_dtensor

__all__ = ["materialize_dtensor", "has_dtensor", "UnsupportedDTensorError", "PeerFailedError",
           "PeerCheckpointError"]
