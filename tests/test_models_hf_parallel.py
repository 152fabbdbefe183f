"""Hugging Face models under FSDP2 and tensor/expert parallelism, 2 gloo ranks, one spawn.

* Init is plan-invariant: GPT-2 (Conv1D, scaled projections), Mixtral (experts, router) and
  Qwen2 materialized with ``seed=0`` under FSDP2 / TP equal the unsharded model bit for bit; so
  do a module whose only rule is its own random ``reset_parameters()`` and an ``init=``
  callable (both run on the global tensor).
* MoE checkpoints from ``save_pretrained`` (one tensor per expert) load into fused experts
  sharded by FSDP2 and by TP/EP, bit-exact against ``from_pretrained``; each rank reads exactly
  the bytes of its blocks.
* One Report for the job: rank 0's ``Report.job`` lists what rank 1 initialised.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from _dist import run_dist
from _hf_models import families, moe_classes, on_meta, save_moe

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers < 5 keeps MoE experts as one module each (no fused experts, "
                "no conversion mapping)", allow_module_level=True)

pytestmark = pytest.mark.multiprocess


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _state(m):
    return {k: _full(v).clone() for k, v in m.state_dict().items()}


def _local_bytes(m) -> int:
    return sum(getattr(v, "_local_tensor", v).numel() * v.element_size()
               for v in m.state_dict().values())


def _fsdp(m, mesh, blocks):
    from torch.distributed.fsdp import fully_shard

    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _shard_param(module, name, mesh, placement):
    """Replace a meta parameter by a meta DTensor with ``placement`` (expert/row parallel)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    p = module._parameters[name]
    local, _ = compute_local_shape_and_global_offset(tuple(p.shape), mesh, [placement])
    x = DTensor.from_local(torch.empty(local, dtype=p.dtype, device="meta"), mesh, [placement],
                           run_check=False, shape=p.shape, stride=p.stride())
    module._parameters[name] = nn.Parameter(x, requires_grad=p.requires_grad)


def _tp_decoder(m, mesh, moe: bool):
    """Attention column/row parallel; MoE experts: gate_up rows (TP), down_proj experts (EP),
    router rows; dense MLPs column/row parallel."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {}
    for i, layer in enumerate(m.model.layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[p + "self_attn." + n] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        if not moe:
            plan[p + "mlp.gate_proj"] = ColwiseParallel()
            plan[p + "mlp.up_proj"] = ColwiseParallel()
            plan[p + "mlp.down_proj"] = RowwiseParallel()
    parallelize_module(m, mesh, plan)
    if moe:
        for layer in m.model.layers:
            _shard_param(layer.mlp.experts, "gate_up_proj", mesh, Shard(1))
            _shard_param(layer.mlp.experts, "down_proj", mesh, Shard(0))
            _shard_param(layer.mlp.gate, "weight", mesh, Shard(0))
    return m


class Rotated(nn.Module):
    """No rule metamat knows: its reset_parameters() draws from torch's RNG."""

    def __init__(self, n, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n, device=device))
        self.b = nn.Parameter(torch.empty(n, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            nn.init.orthogonal_(self.w)
            self.b.normal_(0.0, 3.0)


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.rot = Rotated(6, device=device)
        self.lin = nn.Linear(6, 5, device=device)


def _invariance(rank, mesh):
    import metamat

    out = {}
    fam = families()
    for name, shard in (("gpt2", "fsdp2"), ("mixtral", "fsdp2"), ("mixtral", "tp"),
                        ("qwen2", "tp")):
        cls, cfg = fam[name]
        ref = on_meta(cls, cfg)
        metamat.materialize(ref, seed=0)
        m = on_meta(cls, cfg)
        if shard == "fsdp2":
            blocks = m.transformer.h if name == "gpt2" else m.model.layers
            _fsdp(m, mesh, blocks)
        else:
            _tp_decoder(m, mesh, moe=name == "mixtral")
        rep = metamat.materialize(m, seed=0)
        want, got = _state(ref), _state(m)
        out[f"{name}/{shard}"] = sorted(k for k in want if not torch.equal(want[k], got[k]))
        out[f"{name}/{shard}/warnings"] = rep.warnings
    ref = Net(device="meta")
    metamat.materialize(ref, seed=3, init={"lin.weight": lambda t: t.copy_(
        torch.arange(t.numel(), dtype=t.dtype).view(t.shape))})
    m = _fsdp(Net(device="meta"), mesh, [])
    rep = metamat.materialize(m, seed=3, init={"lin.weight": lambda t: t.copy_(
        torch.arange(t.numel(), dtype=t.dtype).view(t.shape))})
    want, got = _state(ref), _state(m)
    out["reset/fsdp2"] = sorted(k for k in want if not torch.equal(want[k], got[k]))
    out["reset/source"] = rep.sources["rot.w"]
    return out


def _moe_loads(rank, mesh, dirs):
    import metamat

    out = {}
    for kind, d in dirs.items():
        cls, cfg = moe_classes()[kind]
        want = _state(cls.from_pretrained(d))
        for shard in ("fsdp2", "tp"):
            m = on_meta(cls, cfg())
            if shard == "fsdp2":
                _fsdp(m, mesh, m.model.layers)
            else:
                _tp_decoder(m, mesh, moe=True)
            rep = metamat.materialize(m, d)
            got = _state(m)
            out[f"{kind}/{shard}"] = {
                "differ": sorted(k for k in want if not torch.equal(want[k], got[k])),
                "needed": rep.bytes_needed, "local": _local_bytes(m),
                "initialized": rep.initialized, "unexpected": rep.unexpected}
    return out


def _job_report(rank, d):
    import metamat
    from safetensors.torch import save_file

    full = nn.Linear(4, 3)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.state_dict().items()},
                  os.path.join(d, "lin.safetensors"))
    torch.distributed.barrier()
    m = nn.Sequential(nn.Linear(4, 3, device="meta"))
    if rank == 1:  # only rank 1 has a tensor the checkpoint lacks
        m.append(nn.LayerNorm(3, device="meta"))
    rep = metamat.materialize(m, os.path.join(d, "lin.safetensors"), strict=False,
                              rename=lambda k: k[2:] if k.startswith("0.") else k)
    job = rep.job
    return {"ranks": [r.rank for r in rep.ranks], "devices": [r.device for r in rep.ranks],
            "initialized": job.initialized,
            "world": job.world_size, "mine": rep.initialized, "text": str(rep),
            "needed": job.bytes_needed}


def _worker(rank, world, dirs, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {"invariance": _invariance(rank, mesh), "moe": _moe_loads(rank, mesh, dirs),
            "job": _job_report(rank, tmp)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs = {k: save_moe(k, str(tmp_path_factory.mktemp(k))) for k in moe_classes()}
    return dirs, run_dist(_worker, 2, dirs, str(tmp_path_factory.mktemp("job")))


def test_init_is_plan_invariant(results):
    _, res = results
    for r in res:
        inv = r["invariance"]
        for case in ("gpt2/fsdp2", "mixtral/fsdp2", "mixtral/tp", "qwen2/tp", "reset/fsdp2"):
            assert inv[case] == [], (case, inv[case])
            assert not inv.get(case + "/warnings"), inv.get(case + "/warnings")
        assert inv["reset/source"].startswith("reset: Rotated.reset_parameters()")


def test_moe_loads_bit_exact_reading_only_local_blocks(results):
    dirs, res = results
    for kind in dirs:
        for shard in ("fsdp2", "tp"):
            per = [r["moe"][f"{kind}/{shard}"] for r in res]
            for p in per:
                assert p["differ"] == [] and not p["initialized"] and not p["unexpected"], p
                assert p["needed"] == p["local"], (kind, shard, p)  # exactly its blocks
            if shard == "fsdp2":  # every tensor sharded once: the ranks read the model once
                total = sum(v.numel() * v.element_size() for v in
                            moe_classes()[kind][0].from_pretrained(dirs[kind]).state_dict().values())
                assert sum(p["needed"] for p in per) == total


def test_one_report_for_the_job(results):
    _, res = results
    for rank, r in enumerate(res):
        j = r["job"]
        assert j["ranks"] == [0, 1] and j["world"] == 2 and j["devices"] == ["cpu", "cpu"]
        assert j["initialized"] == {"1.bias": [1], "1.weight": [1]}
        assert "job initialised on ranks [1]: 1.weight" in j["text"]
    assert res[0]["job"]["mine"] == [] and res[1]["job"]["mine"] == ["1.bias", "1.weight"]
