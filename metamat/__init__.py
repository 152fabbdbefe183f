"""metamat: materialize meta-device recommendation models fast.

Fused, plan-invariant init (every element a pure function of seed, table name, global row and
column) and rank-local checkpoint loading, with a torch-free C++/CUDA core.

Importing metamat loads neither the compiled core nor torchrec, and never initialises CUDA.
"""
from ._ext import ExtensionNotBuiltError
from .checkpoint import CheckpointError, UnexpectedTensorError, open_checkpoint
from .checkpoint.merge import Merge
from .empty import init_empty_weights
from .errors import (DeviceMemoryError, MissingValueError, PartialLoadError, PeerCheckpointError,
                     PeerFailedError, UnsupportedDTensorError, UnsupportedError)
from .init import fill_, fill_many_
from .materialize import materialize
from .report import Report
from .spec import Constant, Dist, Normal, TruncatedNormal, Uniform, Zeros

__version__ = "0.3.0"

__all__ = [
    "Dist", "Uniform", "Normal", "TruncatedNormal", "Constant", "Zeros",
    "fill_", "fill_many_", "materialize", "Report", "Merge", "shard_on_meta",
    "shard_modules_on_meta",
    "init_empty_weights",
    "open_checkpoint", "CheckpointError", "UnexpectedTensorError", "ExtensionNotBuiltError",
    "UnsupportedError", "UnsupportedDTensorError", "MissingValueError", "PeerFailedError",
    "PeerCheckpointError", "PartialLoadError", "DeviceMemoryError", "release_staging_memory",
]


def __getattr__(name):
    # TorchRec is optional and slow to import: load it only when its API is asked for.
    if name in ("shard_on_meta", "shard_modules_on_meta"):
        from .models import torchrec

        return getattr(torchrec, name)
    if name == "release_staging_memory":
        from .load.staged import release_staging_memory

        return release_staging_memory
    raise AttributeError(f"module 'metamat' has no attribute {name!r}")
