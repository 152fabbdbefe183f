"""TorchRec support: shard on meta, plan, allocate, fill, register."""
from .compat import UnsupportedError
from .shard import shard_on_meta
from .walk import plan_targets

__all__ = ["shard_on_meta", "plan_targets", "UnsupportedError"]
