"""materialize_dtensor on tensor-parallel models (2 gloo ranks, CPU DeviceMesh).

One spawn runs every scenario (spawning costs more than the scenarios): PyTorch's TP
checkpoint case (uneven MLP, Colwise + Rowwise, dcp.save, rebuilt on meta, loaded), the same
model from one safetensors file, an HF index set, torch.save, a DCP written by another plan,
renamed keys, a 2-D mesh, a 3-D tensor sharded on a middle dim, tied parameters, init
invariance across plans and mesh sizes, and a failure on one rank leaving both unchanged.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from _dist import run_dist

pytestmark = pytest.mark.multiprocess


class MLP(nn.Module):
    """PyTorch's TP checkpoint MLP with uneven sizes (7 rows over 2 ranks)."""

    def __init__(self, device=None):
        super().__init__()
        self.net1 = nn.Linear(5, 7, device=device)
        self.net2 = nn.Linear(7, 3, device=device)
        self.net3 = nn.Linear(3, 9, device=device)  # not parallelized: a plain tensor beside

    def forward(self, x):
        return self.net3(torch.relu(self.net2(torch.relu(self.net1(x)))))


class Tied(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Embedding(11, 6, device=device)
        self.norm = nn.LayerNorm(6, device=device)
        self.head = nn.Linear(6, 11, bias=False, device=device)
        self.head.weight = self.emb.weight


def plan_a():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"net1": ColwiseParallel(output_layouts=Replicate()),
            "net2": RowwiseParallel(input_layouts=Replicate())}


def plan_b():  # the other way round: Rowwise on net1, Colwise on net2
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"net1": RowwiseParallel(), "net2": ColwiseParallel()}


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _state(m: nn.Module):
    return {k: _full(v).clone() for k, v in m.state_dict().items()}


def _meta(mesh, plan, cls=MLP):
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(cls(device="meta"), mesh, plan)


def _is_meta(m: nn.Module) -> bool:
    return all((getattr(p, "_local_tensor", p)).is_meta for p in m.parameters())


def _write_checkpoints(rank, d, mesh, full):
    """DCP (plan A and plan B), safetensors file, 2-file index set, torch.save, prefixed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.tensor.parallel import parallelize_module

    for name, plan in (("dcp_a", plan_a()), ("dcp_b", plan_b())):
        m = MLP()
        m.load_state_dict(full)
        dcp.save(parallelize_module(m, mesh, plan).state_dict(),
                 checkpoint_id=os.path.join(d, name))
    if rank == 0:
        save_file(full, os.path.join(d, "model.safetensors"))
        keys = sorted(full)
        shards = {"a.safetensors": keys[:3], "b.safetensors": keys[3:]}
        weight_map = {}
        os.makedirs(os.path.join(d, "hf"))
        for f, ks in shards.items():
            save_file({k: full[k] for k in ks}, os.path.join(d, "hf", f))
            weight_map.update({k: f for k in ks})
        with open(os.path.join(d, "hf", "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)
        torch.save(full, os.path.join(d, "model.pt"))
        save_file({"model." + k: v for k, v in full.items()}, os.path.join(d, "prefixed.safetensors"))
        save_file({"mlp/" + k: v for k, v in full.items()}, os.path.join(d, "renamed.safetensors"))
        bad = dict(full)
        bad["net2.weight"] = torch.zeros(3, 8)
        save_file(bad, os.path.join(d, "bad.safetensors"))
    dist.barrier()


def _scenarios(rank, world, d):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import metamat
    from metamat import PeerCheckpointError, materialize as materialize_dtensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = MLP()
    full = _state(ref)
    _write_checkpoints(rank, d, mesh, full)
    x = torch.randn(4, 5)
    out = {}

    # Load: every format and the other plan's DCP, into plan A; equal tensors and forward.
    for name, kw in (("dcp_a", {}), ("dcp_b", {}), ("model.safetensors", {}), ("hf", {}),
                     ("hf/model.safetensors.index.json", {}), ("model.pt", {}),
                     ("prefixed.safetensors", {}),
                     ("renamed.safetensors", {"rename": lambda k: "mlp/" + k})):
        m = _meta(mesh, plan_a())
        rep = metamat.materialize(m, os.path.join(d, name), **kw)  # dispatches to DTensor
        got = _state(m)
        assert all(torch.equal(got[k], full[k]) for k in full), name
        assert isinstance(m.net1.weight, nn.Parameter) and isinstance(m.net1.weight.data, DTensor)
        assert m.net1.weight.requires_grad
        torch.testing.assert_close(m(x), ref(x), rtol=1e-6, atol=1e-6)
        assert rep.source == "checkpoint" and rep.bytes_read >= rep.bytes_needed > 0
        out[name] = (rep.bytes_needed, rep.bytes_read, rep.read_amplification)
    m = _meta(mesh, plan_a())
    materialize_dtensor(m, os.path.join(d, "model.safetensors"),
                        rename={"net1.weight": "net1.weight"})  # a mapping

    # Each rank reads only its shard: net1.weight rows 0-3 or 4-6 of a (7, 5) float32 matrix.
    m = _meta(mesh, plan_a())
    rep = materialize_dtensor(m, os.path.join(d, "model.safetensors"))
    rows = 4 if rank == 0 else 3  # net1 rows (Colwise), net2 columns (Rowwise): 7 = 4 + 3
    want_elems = rows * 5 + rows + 3 * rows + 3 + 9 * 3 + 9  # + net2 bias, plain net3
    assert rep.bytes_needed == want_elems * 4, (rep.bytes_needed, want_elems * 4)

    # A failure on rank 1 only: both ranks raise a CheckpointError, neither model changes.
    m = _meta(mesh, plan_a())
    path = os.path.join(d, "bad.safetensors" if rank == 1 else "model.safetensors")
    try:
        materialize_dtensor(m, path)
        raise AssertionError("no error")
    except metamat.CheckpointError as e:
        out["fail"] = type(e).__name__
        assert (rank == 1) != isinstance(e, PeerCheckpointError)
    assert _is_meta(m)

    # Init invariance: plan A, plan B and the unsharded model give the same full tensors.
    states = []
    for plan in (plan_a(), plan_b(), None):
        m = _meta(mesh, plan) if plan is not None else MLP(device="meta")
        materialize_dtensor(m, seed=7)
        states.append(_state(m))
    for s in states[1:]:
        assert all(torch.equal(s[k], states[0][k]) for k in s)
    b = 1 / 5 ** 0.5
    assert states[0]["net1.weight"].abs().max() <= b and states[0]["net1.bias"].abs().max() <= b
    ref_w = torch.empty(7, 5)
    metamat.fill_(ref_w, metamat.Uniform(-b, b), seed=7, key="net1.weight")
    assert torch.equal(states[0]["net1.weight"], ref_w)
    # init= overrides by fnmatch
    m = _meta(mesh, plan_a())
    materialize_dtensor(m, seed=7, init={"net2.*": metamat.Normal(0.0, 0.5)})
    ref_w = torch.empty(3, 7)
    metamat.fill_(ref_w, metamat.Normal(0.0, 0.5), seed=7, key="net2.weight")
    assert torch.equal(_full(m.net2.weight), ref_w)

    # 2-D mesh, Shard on both dims (uneven), a 3-D tensor sharded on its middle dim, a buffer.
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))

    def holder():
        h = nn.Module()
        h.w2 = nn.Parameter(distribute_tensor(torch.empty(9, 7, device="meta"), mesh2,
                                              [Shard(1), Shard(0)]))
        h.w3 = nn.Parameter(distribute_tensor(torch.empty(3, 5, 4, device="meta"), mesh,
                                              [Shard(1)]))
        h.register_buffer("buf", distribute_tensor(torch.empty(6, device="meta"), mesh,
                                                   [Shard(0)]))
        return h

    def plain():
        h = nn.Module()
        h.w2 = nn.Parameter(torch.empty(9, 7, device="meta"))
        h.w3 = nn.Parameter(torch.empty(3, 5, 4, device="meta"))
        h.register_buffer("buf", torch.empty(6, device="meta"))
        return h

    init = {"w*": metamat.Uniform(-1, 1), "buf": metamat.Normal(0, 1)}
    h, p = holder(), plain()
    materialize_dtensor(h, seed=3, init=init)
    materialize_dtensor(p, seed=3, init=init)
    hs, ps = _state(h), _state(p)
    assert all(torch.equal(hs[k], ps[k]) for k in ps)
    assert h.w3._local_tensor.shape == ((3, 3, 4) if rank == 0 else (3, 2, 4))
    # ... and loaded: from a full safetensors file and from a DCP saved with another layout.
    from safetensors.torch import save_file
    import torch.distributed.checkpoint as dcp
    if rank == 0:
        save_file(ps, os.path.join(d, "nd.safetensors"))
    src = holder()
    with torch.no_grad():
        src.w2 = nn.Parameter(distribute_tensor(ps["w2"], mesh2, [Shard(0), Shard(1)]))
        src.w3 = nn.Parameter(distribute_tensor(ps["w3"], mesh, [Shard(2)]))
        src.buf = distribute_tensor(ps["buf"], mesh, [Shard(0)])
    dcp.save(src.state_dict(), checkpoint_id=os.path.join(d, "nd_dcp"))
    dist.barrier()
    for name in ("nd.safetensors", "nd_dcp"):
        h = holder()
        materialize_dtensor(h, os.path.join(d, name))
        hs = _state(h)
        assert all(torch.equal(hs[k], ps[k]) for k in ps), name

    # Tied parameters under TP: one storage, materialized once, still tied.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    # (parallelize_module unties them; tie again after, as torchtitan does: both Shard(0))
    t = _meta(mesh, {"emb": RowwiseParallel(), "head": ColwiseParallel()}, Tied)
    t.head.weight = t.emb.weight
    rep = materialize_dtensor(t, seed=1)
    assert t.emb.weight is t.head.weight and not t.emb.weight._local_tensor.is_meta
    assert rep.num_tensors == 3  # emb/head weight once, norm weight and bias
    assert torch.equal(_full(t.norm.weight), torch.ones(6))
    ref_e = torch.empty(11, 6)
    metamat.fill_(ref_e, metamat.Normal(0, 1), seed=1, key="emb.weight")
    assert torch.equal(_full(t.emb.weight), ref_e)
    return out


def test_tp_load_init_fail_tied(tmp_path):
    res = run_dist(_scenarios, 2, str(tmp_path))
    for r in res:
        assert r["fail"] in ("ShapeMismatchError", "PeerCheckpointError")
        for name in ("model.safetensors", "hf", "model.pt"):
            needed, read, amp = r[name]
            assert amp == pytest.approx(read / needed) and amp < 1.5, (name, r[name])
