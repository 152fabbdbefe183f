"""TorchRec tables on a real GPU: what the emulated device (test_torchrec_gpu_emulated.py)
cannot show. One NCCL rank on one GPU, for each location (DEVICE, UVM managed, UVM
host-mapped, UVM caching LRU and LFU, all of them mixed with dense data-parallel tables), and
EmbeddingCollections (mixed locations; the DENSE kernel, which cannot train on the CPU):

* ``materialize`` puts UVM tables in fbgemm's unified memory (managed or host-mapped) and the
  rest in device memory, with the CPU materialize's values, bit for bit;
* a forward, backward and fused-optimizer step give the outputs and updated tables and
  optimizer state of an eager TorchRec DMP on CUDA holding the same values;
* a DCP checkpoint of the trained eager model loads into a fresh model and, in place, into
  the live one whose LXU cache holds newer rows: the next forward equals the eager model's
  (no stale cached row survives or is written back).

Needs a GPU, fbgemm-gpu's CUDA build and torchrec (scripts/gpu_check.sh installs them).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

pytestmark = pytest.mark.cuda
SEED = 9

CASES = {
    "device": ({"t0": ("tw", "fused"), "t1": ("rw", "fused"), "t2": ("cw", "fused")}, {}),
    "managed": ({"t0": ("tw", "fused_uvm"), "t1": ("rw", "fused_uvm")}, {}),
    "host-mapped": ({"t0": ("tw", "fused_uvm"), "t1": ("cw", "fused_uvm")},
                    {"uvm_host_mapped": True}),
    "caching-lru": ({"t0": ("tw", "fused_uvm_caching"), "t1": ("rw", "fused_uvm_caching")}, {}),
    "caching-lfu": ({"t0": ("tw", "fused_uvm_caching"), "t1": ("cw", "fused_uvm_caching")},
                    {"cache_algorithm": "LFU"}),
    "mixed": (M.MIXED, {}),
    "ec-mixed": (M.MIXED_EC, {}),
    "ec-dense": (M.DENSE_EC, {}),  # fbgemm's CUDA dense TBE does sequence lookups
    "pec": ({"t0": ("rw", "fused"), "t1": ("rw", "fused_uvm_caching")}, {}),  # row-wise only
}
KIND = {"ec-mixed": "ec", "ec-dense": "ec", "pec": "pec"}  # the rest: EmbeddingBagCollections


def _extra(extra):
    out = dict(extra)
    if "cache_algorithm" in out:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

        out["cache_algorithm"] = CacheAlgorithm[out["cache_algorithm"]]
    return out


def _state(model):
    out = M.local_blocks(model.state_dict())
    out.update(M.optimizer_blocks(model))
    return out


def _close(a: dict, b: dict) -> list:
    bad = []
    for k in a:
        for (o1, x), (o2, y) in zip(a[k], b[k]):
            if o1 != o2 or x.shape != y.shape or not torch.allclose(x.float(), y.float(),
                                                                     rtol=1e-5, atol=1e-6):
                bad.append(k)
    return bad


def worker_train(rank, world_size, case, tmp, via="shard_on_meta"):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    layout, extra = CASES[case]
    extra = _extra(extra)
    kind = KIND.get(case, "ebc")
    dev = torch.device("cuda", rank)
    res = {}
    module, sharder, plan, tables = M.build(kind, layout, world_size, extra=extra)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    if via == "dmp":  # TorchRec's own DMP on meta: fbgemm's CPU layout, laid out again
        gpu = DistributedModelParallel(module, env, device=torch.device("meta"), plan=plan,
                                       sharders=[sharder], init_parameters=False)
    else:
        gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder],
                                    compute_device="cuda")
    report = metamat.materialize(gpu, seed=SEED)
    res["device"], res["memory"] = report.device, report.bytes_by_memory
    uvm = []
    for w in M.wrappers(gpu):
        emb = w._emb_module
        if hasattr(emb, "weights_uvm") and emb.weights_uvm.numel():
            uvm.append((bool(torch.ops.fbgemm.is_uvm_tensor(emb.weights_uvm)),
                        str(emb.weights_uvm.device), M.memory_kind(emb.weights_uvm)))
        if hasattr(emb, "weights_dev") and emb.weights_dev.numel():
            res.setdefault("dev_not_uvm", []).append(
                not torch.ops.fbgemm.is_uvm_tensor(emb.weights_dev)
                and emb.weights_dev.device == dev)
    res["uvm"] = uvm
    # the CPU materialize of the same tables: the same bits
    cmod, csharder, cplan, _ = M.build(kind, M.cpu_layout(layout), world_size,
                                       device_type="cpu")
    cpu = metamat.shard_on_meta(cmod, plan=cplan, sharders=[csharder])
    metamat.materialize(cpu, device="cpu", seed=SEED)
    init_g, init_c = _state(gpu), _state(cpu)
    res["init_bits"] = [k for k in init_c if any(
        not torch.equal(x, y) for (_, x), (_, y) in zip(init_g[k], init_c[k]))]
    # an eager TorchRec DMP on the GPU holding the same values
    emod, _, _, _ = M.build(kind, layout, world_size, extra=extra)
    eager = DistributedModelParallel(emod, env, device=dev, plan=plan, sharders=[sharder])
    eager.load_state_dict(gpu.state_dict())
    # the kind of unified memory fbgemm gave the eager model's tables, as CUDA reports it
    res["eager_uvm"] = [M.memory_kind(w._emb_module.weights_uvm) for w in M.wrappers(eager)
                        if getattr(w._emb_module, "weights_uvm", torch.empty(0)).numel()]
    outs = []
    for step in range(2):
        b = M.batch(len(tables), seed=step, device=dev)
        outs.append((M.train_step(gpu, b), M.train_step(eager, b)))
    res["out_close"] = [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in outs]
    res["after"] = _close(_state(gpu), _state(eager))
    # the trained eager model's checkpoint, into a fresh model and into the live one
    path = os.path.join(tmp, "trained")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=path)
    fresh = metamat.shard_on_meta(M.build(kind, layout, world_size, extra=extra)[0],
                                  plan=plan, sharders=[sharder], compute_device="cuda")
    metamat.materialize(fresh, path)
    M.train_step(gpu, M.batch(len(tables), seed=7, device=dev))  # the cache holds newer rows
    metamat.materialize(gpu, path)  # in place (shadow copies)
    b = M.batch(len(tables), seed=8, device=dev)
    want = M.forward(eager, b).detach().cpu()
    res["fresh_forward"] = torch.allclose(M.forward(fresh, b).detach().cpu(), want)
    res["fresh_state"] = _close(_state(fresh), _state(eager))  # every row and the state
    res["live_forward"] = torch.allclose(M.forward(gpu, b).detach().cpu(), want)
    res["live_state"] = _close(_state(gpu), _state(eager))
    return res


@pytest.mark.parametrize("case,via", [(c, "shard_on_meta") for c in CASES] + [("mixed", "dmp")])
def test_materialize_train_and_load_like_eager_torchrec(case, via, tmp_path):
    if KIND.get(case) == "pec":
        pytest.importorskip("torchrec.modules.pec_embedding_modules")  # torchrec >= 1.8
    r = run_dist(worker_train, 1, case, str(tmp_path), via, backend="nccl")[0]
    layout, extra = CASES[case]
    assert r["device"].startswith("cuda:"), r["device"]
    assert r["init_bits"] == [], r["init_bits"]
    kinds = {k for _, k in layout.values()}
    if kinds & {"fused_uvm", "fused_uvm_caching"}:
        mapped = bool(extra.get("uvm_host_mapped"))
        want, other = ("uvm_host_mapped", "uvm") if mapped else ("uvm", "uvm_host_mapped")
        assert want in r["memory"] and other not in r["memory"], r["memory"]
        assert r["uvm"] and all(is_uvm and d.startswith("cuda") for is_uvm, d, _ in r["uvm"])
        # the memory kind as CUDA sees it, as fbgemm allocated it for the eager model
        kind = "host-mapped" if mapped else "managed"
        assert r["eager_uvm"] and set(r["eager_uvm"]) == {kind}, r["eager_uvm"]
        assert {m for _, _, m in r["uvm"]} == {kind}, r["uvm"]
    assert all(r.get("dev_not_uvm", [True]))
    assert all(r["out_close"]), r["out_close"]
    assert r["after"] == [], r["after"]
    assert r["fresh_forward"] and r["live_forward"], r
    assert r["fresh_state"] == [], r["fresh_state"]
    assert r["live_state"] == [], r["live_state"]
