"""A tensor-parallel model (DTensor) built on meta: initialised, and loaded from safetensors.

    torchrun --nproc_per_node 2 examples/tensor_parallel.py      # 2 ranks (gloo, CPU mesh)

1. A small feed-forward block is built on meta and parallelized with PyTorch's tensor
   parallel API (``ColwiseParallel`` / ``RowwiseParallel``): its parameters are DTensors
   sharded over a 2-rank mesh, with nothing allocated.
2. ``metamat.materialize(model, seed=0)``: each rank allocates its shards and fills them; the
   values are those the same model gets unsharded (checked against a 1-rank build).
3. ``metamat.materialize(model, "ffn.safetensors")``: another copy, on meta, is loaded from
   one safetensors file of the whole model; each rank reads only its rows or columns.
   Its output equals the unsharded reference model's.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import metamat


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, device=None):
        super().__init__()
        self.up = nn.Linear(dim, hidden, device=device)
        self.down = nn.Linear(hidden, dim, device=device)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def tp_on_meta(dim: int, hidden: int, mesh) -> FeedForward:
    model = FeedForward(dim, hidden, device="meta")
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def whole(model) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out", default="/tmp/metamat_tp_example")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    # 1-2. Init on meta, then materialize: the same values as the unsharded model gets.
    model = tp_on_meta(a.dim, a.hidden, mesh)
    metamat.materialize(model, seed=0)
    unsharded = FeedForward(a.dim, a.hidden, device="meta")
    metamat.materialize(unsharded, seed=0, device="cpu")
    same_init = all(torch.equal(v, unsharded.state_dict()[k]) for k, v in whole(model).items())
    if rank == 0:
        print(f"sharded init equal to the unsharded init: {same_init}")

    # 3. Load from one safetensors file of the whole model (here: written by rank 0).
    path = os.path.join(a.out, "ffn.safetensors")
    torch.manual_seed(0)
    reference = FeedForward(a.dim, a.hidden)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        save_file(reference.state_dict(), path)
    dist.barrier()
    loaded = tp_on_meta(a.dim, a.hidden, mesh)
    report = metamat.materialize(loaded, path)
    print(f"rank {rank}: read {report.bytes_read:,} of the file's "
          f"{os.path.getsize(path):,} bytes (its shards: {report.bytes_needed:,})")
    x = torch.randn(4, a.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        same_out = torch.allclose(loaded(x), reference(x), rtol=1e-5, atol=1e-6)
    same_weights = all(torch.equal(v, reference.state_dict()[k]) for k, v in whole(loaded).items())
    ok = same_init and same_out and same_weights
    if rank == 0:
        print(f"loaded weights equal: {same_weights}; output equal to the reference: {same_out}")
        print("OK" if ok else "FAILED")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
