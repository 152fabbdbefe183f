"""TorchRec's composable sharding (``torchrec.distributed.shard_modules``, no DMP around the
model) on meta, beside a dense part sharded with FSDP2's ``fully_shard``: ``metamat.
shard_modules_on_meta`` + ``materialize`` on 2 gloo ranks give the tables the values a DMP of
the same tables gets and the dense layers those of the plain model, train like the same model
sharded eagerly by TorchRec and FSDP2, and load a DCP checkpoint of it bit for bit (TorchRec's
own ``shard_modules(device=meta)`` cannot build the EmbeddingCollection: its placements keep
the plan's device while its tensors are on meta, measured on torchrec 1.9.2)."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

BAGS = {"t0": ("tw", "fused"), "t1": ("rw", "fused"), "t2": ("cw", "fused"),
        "t3": ("dp", "dense")}
SEQS = {"s0": ("rw", "fused"), "s1": ("tw", "fused")}
POOLED = sum(M.dim_of(i) for i in range(len(BAGS)))
SEED = 6


class Net(nn.Module):
    """Pooled tables, sequence tables and dense layers (the parts FSDP2 shards)."""

    def __init__(self, device) -> None:
        super().__init__()
        self.sparse = M.build("ebc", BAGS, 2, device_type="cpu", device=device)[0]
        self.seq = M.build("ec", SEQS, 2, device_type="cpu", device=device)[0]
        self.dense = nn.Sequential(nn.Linear(4, 16, device=device), nn.ReLU(),
                                   nn.Linear(16, 8, device=device))
        self.over = nn.Linear(8 + POOLED, 1, device=device)

    def forward(self, dense, bags, seqs):
        pooled = M.forward(self.sparse, bags).reshape(dense.shape[0], -1)
        seq = M.forward(self.seq, seqs)
        return self.over(torch.cat([self.dense(dense), pooled], dim=1)).sum() + seq.sum()


def _plan_and_sharders(world_size: int = 2, device_type: str = "cpu"):
    from torchrec.distributed.types import ShardingPlan

    _, bag_sharder, bag_plan, _ = M.build("ebc", BAGS, world_size, device_type=device_type)
    _, seq_sharder, seq_plan, _ = M.build("ec", SEQS, world_size, device_type=device_type)
    plan = ShardingPlan({"sparse": bag_plan.plan[""], "seq": seq_plan.plan[""]})
    return plan, [bag_sharder, seq_sharder]


def _on_meta(mesh):
    from torch.distributed.fsdp import fully_shard

    plan, sharders = _plan_and_sharders()
    net = metamat.shard_modules_on_meta(Net(torch.device("meta")), plan=plan,
                                        sharders=sharders)
    fully_shard(net.dense, mesh=mesh)
    fully_shard(net.over, mesh=mesh)
    return net


def _step(net, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    loss = net(torch.randn(4, 4, generator=g), M.batch(len(BAGS), seed=10 * step + rank),
               M.batch(len(SEQS), seed=20 * step + rank))
    loss.backward()  # the fused tables update in the backward
    with torch.no_grad():  # plain SGD on the rest (FSDP2 reduce-scattered the dense grads)
        for p in net.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.05)
                p.grad = None
    return loss.detach()


def _blocks(net) -> dict:
    out = {}
    for k, v in net.state_dict().items():
        if hasattr(v, "full_tensor"):  # FSDP2's DTensors: compared whole
            out[k] = [((0,) * v.dim(), v.full_tensor())]
        else:
            out.update(M.local_blocks({k: v}))
    return out


def worker(rank, world_size, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchrec.distributed.shard import shard_modules
    from torchrec.distributed.types import ShardingEnv

    mesh = init_device_mesh("cpu", (world_size,))
    net = _on_meta(mesh)
    report = metamat.materialize(net, seed=SEED)
    res = {"kinds": sorted({type(m).__name__ for m in (net.sparse, net.seq)}),
           "init": _blocks(net), "memory": report.bytes_by_memory}
    # the same tables in a DMP, the same dense layers unsharded: metamat's values there
    plan, sharders = _plan_and_sharders()
    dmp = metamat.shard_on_meta(Net(torch.device("meta")), plan=plan, sharders=sharders)
    metamat.materialize(dmp, seed=SEED)
    res["dmp"] = M.local_blocks(dmp.state_dict())
    # TorchRec and FSDP2 eagerly, holding our values: the same training
    eager = shard_modules(Net(torch.device("cpu")),
                          env=ShardingEnv.from_process_group(dist.group.WORLD),
                          device=torch.device("cpu"), plan=plan, sharders=sharders)
    fully_shard(eager.dense, mesh=mesh)
    fully_shard(eager.over, mesh=mesh)
    eager.load_state_dict(net.state_dict())
    res["losses"] = [(_step(net, s, rank), _step(eager, s, rank)) for s in range(2)]
    res["trained"], res["eager"] = _blocks(net), _blocks(eager)
    path = os.path.join(tmp, "ckpt")
    dcp.save(net.state_dict(), checkpoint_id=path)
    back = _on_meta(mesh)
    metamat.materialize(back, path)
    res["loaded"] = _blocks(back)
    return res


@pytest.mark.multiprocess
def test_composable_sharding_with_fsdp2_dense(tmp_path):
    ranks = run_dist(worker, 2, str(tmp_path))
    for r in ranks:
        assert r["kinds"] == ["ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection"]
        # tables and dense layers: the DMP's values
        assert sorted(r["init"]) == sorted(r["dmp"])
        for k, blocks in r["dmp"].items():
            assert len(r["init"][k]) == len(blocks), k
            if k.startswith(("sparse.", "seq.")):
                assert [o for o, _ in r["init"][k]] == [o for o, _ in blocks], k
                for (_, a), (_, b) in zip(r["init"][k], blocks):
                    assert torch.equal(M.bits(a), M.bits(b)), k
            else:  # the dense layers: whole on the DMP side, FSDP2-sharded on ours
                assert torch.equal(M.bits(r["init"][k][0][1]), M.bits(blocks[0][1])), k
        for ours, eager in r["losses"]:
            assert torch.equal(M.bits(ours), M.bits(eager))
        assert sorted(r["trained"]) == sorted(r["eager"])
        assert sorted(r["loaded"]) == sorted(r["eager"])
        for k in r["eager"]:
            assert len(r["trained"][k]) == len(r["eager"][k]) == len(r["loaded"][k]), k
            for (o1, a), (o2, b) in zip(r["trained"][k], r["eager"][k]):
                assert o1 == o2 and torch.equal(M.bits(a), M.bits(b)), k
            for (_, a), (_, b) in zip(r["loaded"][k], r["trained"][k]):
                assert torch.equal(M.bits(a), M.bits(b)), f"DCP load {k}"
    changed = [k for k in ranks[0]["init"] if any(
        not torch.equal(a, b) for (_, a), (_, b) in zip(ranks[0]["init"][k],
                                                        ranks[0]["trained"][k]))]
    assert any(k.startswith("sparse.") for k in changed)
    assert any(k.startswith("dense.") for k in changed)


def _gpu_net(mesh, layout_kernel: str, world_size: int = 2):
    """The same model with its tables laid out for fbgemm's CUDA kernels (``layout_kernel``
    for the table-wise and row-wise tables), FSDP2 on the dense layers."""
    from torch.distributed.fsdp import fully_shard
    from torchrec.distributed.types import ShardingPlan

    plan, sharders = _plan_and_sharders(world_size, "cuda")
    for mp in plan.plan.values():
        for name, ps in mp.items():
            if ps.compute_kernel == "fused" and ps.sharding_type != "column_wise":
                ps.compute_kernel = layout_kernel
    plan = ShardingPlan(plan.plan)
    net = metamat.shard_modules_on_meta(Net(torch.device("meta")), plan=plan,
                                        sharders=sharders, compute_device="cuda")
    fully_shard(net.dense, mesh=mesh)
    fully_shard(net.over, mesh=mesh)
    return net


def worker_emulated(rank, world_size, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from metamat.emulation import emulated_cuda

    mesh = init_device_mesh("cpu", (world_size,))
    net = _gpu_net(mesh, "fused_uvm_caching")
    with emulated_cuda():
        report = metamat.materialize(net, seed=SEED)
    cpu = _on_meta(mesh)
    metamat.materialize(cpu, seed=SEED)
    path = os.path.join(tmp, "gpu")
    dcp.save(net.state_dict(), checkpoint_id=path)
    back = _on_meta(mesh)
    metamat.materialize(back, path)
    return dict(device=report.device, memory=report.bytes_by_memory, gpu=_blocks(net),
                cpu=_blocks(cpu), back=_blocks(back))


@pytest.mark.multiprocess
def test_composable_sharding_laid_out_for_gpus_emulated(tmp_path):
    """Tables laid out for GPUs (device memory and UVM caching), on the emulated device: the
    CPU layout's values, dense shards included; its DCP checkpoint loads into the CPU one."""
    for r in run_dist(worker_emulated, 2, str(tmp_path)):
        assert r["device"] == "cuda (emulated on the CPU)" and "uvm" in r["memory"]
        assert sorted(r["gpu"]) == sorted(r["cpu"]) == sorted(r["back"])
        for k in r["cpu"]:
            assert len(r["gpu"][k]) == len(r["cpu"][k]) == len(r["back"][k]), k
            for (o1, a), (o2, b), (_, c) in zip(r["gpu"][k], r["cpu"][k], r["back"][k]):
                assert o1 == o2 and torch.equal(M.bits(a), M.bits(b)), k
                assert torch.equal(M.bits(c), M.bits(b)), k


def _init_mismatches(net) -> list:
    """Keys of ``net``'s blocks (tables' local shards, the dense layers whole) whose bits
    differ from the same block of the unsharded model materialized on the CPU (the values are
    plan invariant: keyed by table, global row and column)."""
    ref = Net(torch.device("meta"))
    metamat.materialize(ref, device="cpu", seed=SEED)
    return M.block_mismatches(_blocks(net), ref.state_dict())


def _state_mismatches(a, b) -> list:
    """Keys whose blocks (tables, dense layers, the tables' fused optimizer state) differ
    between models ``a`` and ``b`` beyond float tolerance."""
    def state(net):
        out = _blocks(net)
        for part in ("sparse", "seq"):
            out.update({f"{part}.{k}": v
                        for k, v in M.optimizer_blocks(getattr(net, part)).items()})
        return out

    sa, sb = state(a), state(b)
    bad = [k for k in sa.keys() ^ sb.keys()]
    for k in sa.keys() & sb.keys():
        for (o1, x), (o2, y) in zip(sa[k], sb[k]):
            if o1 != o2 or x.shape != y.shape or not torch.allclose(
                    x.detach().cpu().float(), y.detach().cpu().float(), rtol=1e-5, atol=1e-6):
                bad.append(k)
    return bad


def worker_gpu(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchrec.distributed.shard import shard_modules
    from torchrec.distributed.types import ShardingEnv

    dev = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world_size,))
    net = _gpu_net(mesh, "fused", world_size)
    metamat.materialize(net, seed=SEED)
    res = {"init_bits": _init_mismatches(net)}  # the GPU's values: the CPU's, bit for bit
    plan, sharders = _plan_and_sharders(world_size, "cuda")
    eager = shard_modules(Net(dev), env=ShardingEnv.from_process_group(dist.group.WORLD),
                          device=dev, plan=plan, sharders=sharders)
    fully_shard(eager.dense, mesh=mesh)
    fully_shard(eager.over, mesh=mesh)
    eager.load_state_dict(net.state_dict())
    # the same ids in both steps: the second loss reads every row the first step updated
    bags = M.batch(len(BAGS), seed=0, device=dev)
    seqs = M.batch(len(SEQS), seed=0, device=dev)
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        args = (torch.randn(4, 4, generator=g).to(dev), bags, seqs)
        pair = []
        for m in (net, eager):
            loss = m(*args)
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-0.05)
                        p.grad = None
            pair.append(float(loss))
        losses.append(pair)
    res["losses"] = losses
    res["after"] = _state_mismatches(net, eager)  # tables, optimizer state, dense layers
    return res


@pytest.mark.cuda
def test_composable_sharding_on_a_gpu_trains_like_eager():
    """One GPU (one rank: the layout, kernels and FSDP2 on CUDA, no real split of rows): the
    CPU materialize's values, then two steps on the same ids like TorchRec and FSDP2 eagerly
    (losses, tables, fused optimizer state and dense layers after them)."""
    r = run_dist(worker_gpu, 1, backend="nccl")[0]
    assert r["init_bits"] == [], r["init_bits"]
    for ours, eager in r["losses"]:
        assert abs(ours - eager) <= 1e-5 * max(1.0, abs(eager)), (ours, eager)
    assert r["after"] == [], r["after"]


def test_cpu_layout_is_not_laid_out_again_for_a_gpu(world1_env):
    """Without a DMP around them, tables laid out for the CPU cannot be laid out again for a
    GPU: refused by name, nothing allocated (where a GPU is visible, ``compute_device``
    defaults to "cuda", so only an explicit CPU layout gets here)."""
    from metamat.emulation import emulated_cuda

    model = nn.ModuleDict({"sparse": M.build("ebc", {"t0": ("tw", "fused")}, 1,
                                             device_type="cpu")[0]})
    model = metamat.shard_modules_on_meta(model, env=world1_env, compute_device="cpu")
    with emulated_cuda(), pytest.raises(metamat.UnsupportedError,
                                        match=r"shard_modules_on_meta\(\.\.\., "
                                              r"compute_device='cuda'\)"):
        metamat.materialize(model, seed=0)
    assert all(s.tensor.is_meta for v in model.state_dict().values()
               if hasattr(v, "local_shards") for s in v.local_shards())
