"""Checkpoint readers: DCP, safetensors (single file and HF shard sets), torch.save.

Each reader reduces a checkpoint to ``fqn -> TensorEntry`` (boxes of the global tensor and the
file byte ranges holding them) without reading tensor data; ``metamat.load`` plans and
executes the reads.
"""
from .base import Checkpoint, Chunk, TensorEntry
from .errors import (CheckpointError, ChecksumMismatchError, CoverageError, DestinationError,
                     DtypeMismatchError, HeaderTooLargeError, InvalidHeaderError,
                     InvalidOffsetError, KeyCollisionError, LimitExceededError, MissingFileError,
                     MissingTensorError, OverlappingChunksError, ReadError,
                     ShapeMismatchError, TruncatedFileError, UnexpectedTensorError,
                     UnsafePathError, UnsafePickleError, UnsupportedFormatError,
                     WriteError)
from .open import open_checkpoint

__all__ = [
    "Checkpoint", "Chunk", "TensorEntry", "open_checkpoint",
    "CheckpointError", "ChecksumMismatchError", "CoverageError", "DestinationError", "DtypeMismatchError",
    "HeaderTooLargeError", "InvalidHeaderError", "InvalidOffsetError", "MissingFileError",
    "MissingTensorError", "OverlappingChunksError", "ReadError", "ShapeMismatchError",
    "TruncatedFileError", "UnexpectedTensorError", "UnsupportedFormatError",
    "KeyCollisionError", "LimitExceededError", "UnsafePathError", "UnsafePickleError",
    "WriteError",
]
