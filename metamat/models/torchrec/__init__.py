"""TorchRec adapter: shard a model on meta (``shard_on_meta``), find its tables, optimizer
state and metadata (walk), register the real tensors (register)."""
from ...errors import UnsupportedError
from .shard import shard_modules_on_meta, shard_on_meta

__all__ = ["shard_on_meta", "shard_modules_on_meta", "UnsupportedError"]
