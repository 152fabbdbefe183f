"""Helpers for tests and benchmarks of code that uses metamat (the project's own tests and
``bench/`` use them too): a one-process gloo group, and DCP checkpoints of many chunks or
many tensors. TorchRec models of N tables: :mod:`metamat.models.torchrec.testing`.

Nothing here is used by metamat itself.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Iterator

import torch
from torch import nn

__all__ = ["process_group", "save_chunked", "save_many", "OneTensor", "ManyTensors"]


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """A world-size-1 gloo group for TorchRec and DCP, destroyed on exit (an existing default
    group is kept, and left alone).

    Its store is a file in a fresh temporary directory, not a TCP port: any number of these
    (pytest-xdist workers, parallel jobs) can run at once without a port to collide on."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    d = tempfile.mkdtemp(prefix="metamat-pg-")
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        shutil.rmtree(d, ignore_errors=True)


def save_chunked(path: str, n: int, layout: str, width: int = 16) -> torch.Size:
    """Save one tensor ``"w"`` with DCP as ``n`` row chunks (``layout="rows"``: n x width)
    or column chunks (``"cols"``: 4 x n); its values are ``arange``. Needs a process group
    (:func:`process_group`). Returns the tensor's shape."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if layout == "rows":
        shape = torch.Size([n, width])
        boxes = [([i, 0], [1, width]) for i in range(n)]
    else:
        shape = torch.Size([4, n])
        boxes = [([0, i], [4, 1]) for i in range(n)]
    full = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape)
    shards = [Shard(full[o[0]:o[0] + s[0], o[1]:o[1] + s[1]].contiguous(),
                    ShardMetadata(o, s, "rank:0/cpu")) for o, s in boxes]
    st = ShardedTensor._init_from_local_shards(shards, shape)
    dcp.save({"w": st}, checkpoint_id=path)
    return shape


def save_many(path: str, n: int, numel: int = 16) -> None:
    """Save ``n`` tensors ``p0 .. p{n-1}`` of ``numel`` floats (``p{i}`` all ``i``) with DCP."""
    import torch.distributed.checkpoint as dcp

    dcp.save({f"p{i}": torch.full((numel,), float(i)) for i in range(n)}, checkpoint_id=path)


class ManyTensors(nn.Module):
    """``n`` parameters ``p{i}`` of ``numel`` elements on meta (what :func:`save_many` saves)."""

    def __init__(self, n: int, numel: int = 16):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"p{i}", nn.Parameter(torch.empty(numel, device="meta")))


class OneTensor(nn.Module):
    """One parameter ``w`` of ``shape`` on meta (what :func:`save_chunked` saves)."""

    def __init__(self, shape):
        super().__init__()
        self.w = nn.Parameter(torch.empty(shape, device="meta"))
