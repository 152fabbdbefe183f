"""TorchRec tables laid out for GPUs, materialized end to end on the emulated CUDA device.

``shard_on_meta(compute_device="cuda")`` builds fbgemm's CUDA layout (DEVICE, UVM and
UVM-caching tables, dense data-parallel tables) on meta; ``materialize`` under
:func:`metamat.emulation.emulated_cuda` runs the whole GPU path with CPU storages standing
where device and unified memory go (planning, allocation by memory kind, the init kernel's
host emulation, staged loads through the host sink, cache handling, registration). Checked
against metamat's CPU materialize of the same tables (values are plan-invariant), against
fbgemm-gpu-cpu TBEs built with the same CUDA specs, and against the checkpoints written.
What only a GPU shows is in tests/test_torchrec_gpu.py (marked ``cuda``).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

SEED = 5
CPU_LACKS = ("ADAM", "PARTIAL_ROWWISE_ADAM", "LAMB", "PARTIAL_ROWWISE_LAMB")  # fbgemm CPU


def _state(model) -> dict:
    out = M.local_blocks(model.state_dict())
    if hasattr(model, "fused_optimizer"):
        out.update(M.optimizer_blocks(model))
    return out


def _placement_devices(model) -> list:
    out = set()
    for v in model.state_dict().values():
        if hasattr(v, "metadata"):
            out |= {str(sm.placement.device()) for sm in v.metadata().shards_metadata}
    return sorted(out)


def worker_init(rank, world_size, kind, layout, opts, tmp):
    """Emulated-GPU materialize and a CPU materialize of the same tables; the emulated model
    saved with DCP and loaded back into a CPU one."""
    import torch.distributed.checkpoint as dcp

    import metamat
    from metamat.emulation import emulated_cuda

    module, sharder, plan, _ = M.build(kind, layout, world_size, **opts)
    gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    with emulated_cuda():
        report = metamat.materialize(gpu, seed=SEED)
    if opts.get("optimizer") in CPU_LACKS:  # fbgemm's CPU kernels: the tables only
        opts = dict(opts, optimizer="EXACT_ROWWISE_ADAGRAD")
    module, sharder, plan, _ = M.build(kind, M.cpu_layout(layout), world_size,
                                       device_type="cpu", **opts)
    cpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
    metamat.materialize(cpu, device="cpu", seed=SEED)
    res = dict(memory=report.bytes_by_memory, device=report.device, gpu=_state(gpu),
               cpu=_state(cpu), buffers=M.fbgemm_mismatches(gpu),
               placements=_placement_devices(gpu),
               meta_left=[n for n, t in list(gpu.named_parameters()) + list(gpu.named_buffers())
                          if t.is_meta])
    path = os.path.join(tmp, "saved")
    dcp.save(gpu.state_dict(), checkpoint_id=path)  # TorchRec's own state_dict, as users save
    back = metamat.shard_on_meta(M.build(kind, M.cpu_layout(layout), world_size,
                                         device_type="cpu", **opts)[0], plan=plan,
                                 sharders=[sharder])
    metamat.materialize(back, path, device="cpu")
    res["roundtrip"] = M.local_blocks(back.state_dict())
    return res


CASES = {
    "ebc-mixed-world2": ("ebc", M.MIXED, {}, 2),
    "ec-world2": ("ec", M.MIXED_EC, {}, 2),
    "ec-dense-world2": ("ec", M.DENSE_EC, {}, 2),
    "pec-world2": ("pec", {"t0": ("rw", "fused"), "t1": ("rw", "fused_uvm"),
                           "t2": ("rw", "fused_uvm_caching")}, {}, 2),
    "fpebc-world2": ("fpebc", {"t0": ("rw", "fused_uvm_caching"), "t1": ("tw", "fused"),
                               "t2": ("cw", "fused_uvm")}, {}, 2),
    "dlrm-world1": ("dlrm", {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm_caching"),
                             "t2": ("cw", "fused_uvm"), "t3": ("dp", "dense")}, {}, 1),
    "fp16-host-mapped-lfu": ("ebc", {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm"),
                                     "t2": ("cw", "fused_uvm_caching")},
                             dict(data_type="FP16",
                                  extra={"uvm_host_mapped": True, "cache_algorithm": "LFU"}), 1),
    # fbgemm has no bf16 cache ("cache_precision bf16 not supported", also on a GPU): the
    # sharder names an fp32 one
    "bf16-adam": ("ebc", {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm_caching")},
                  dict(data_type="BF16", optimizer="ADAM", extra={"cache_precision": "FP32"}), 1),
    # enforce_hbm keeps the rows and momentum1 in device memory; fbgemm leaves momentum2 in UVM
    "adam-enforce-hbm": ("ebc", {"t0": ("tw", "fused_uvm"), "t1": ("rw", "fused_uvm_caching")},
                         dict(optimizer="ADAM", extra={"enforce_hbm": True}), 1),
    "adagrad": ("ebc", {"t0": ("tw", "fused_uvm"), "t1": ("cw", "fused_uvm_caching")},
                dict(optimizer="EXACT_ADAGRAD"), 1),
    "sgd": ("ebc", {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm_caching")},
            dict(optimizer="EXACT_SGD"), 1),
}


def _opts(opts):
    out = dict(opts)
    extra = dict(out.pop("extra", {}) or {})
    if "cache_algorithm" in extra:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

        extra["cache_algorithm"] = CacheAlgorithm[extra["cache_algorithm"]]
    if "cache_precision" in extra:
        from fbgemm_gpu.split_embedding_configs import SparseType

        extra["cache_precision"] = SparseType[extra["cache_precision"]]
    if extra:
        out["extra"] = extra
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_init_equals_cpu_materialize_and_fbgemm(case, tmp_path):
    kind, layout, opts, world = CASES[case]
    if kind == "pec":
        pytest.importorskip("torchrec.modules.pec_embedding_modules")  # torchrec >= 1.8
    ranks = run_dist(worker_init, world, kind, layout, _opts(opts), str(tmp_path))
    gpu, cpu = [r["gpu"] for r in ranks], [r["cpu"] for r in ranks]
    # every table, dense parameter and optimizer state: the CPU materialize's bits
    keys = None
    if opts.get("optimizer") in CPU_LACKS:
        keys = sorted({k for r in cpu for k in r if not k.startswith("state.")})
        state = [t for r in gpu for k, v in r.items() if k.startswith("state.") for _, t in v]
        assert len(state) >= 2 * len(layout) and all(not t.any() for t in state)
    M.assert_same(gpu, cpu, case, keys)
    assert all(r["meta_left"] == [] for r in ranks)
    assert all(r["buffers"] == [] for r in ranks), [r["buffers"] for r in ranks]
    assert all(r["device"] == "cuda (emulated on the CPU)" for r in ranks)
    assert all(r["placements"] == ["cpu"] for r in ranks)
    kernels = {k for _, k in layout.values()}
    uvm = "uvm_host_mapped" if "host-mapped" in case else "uvm"
    for r in ranks:
        assert ("fused_uvm" in kernels or "fused_uvm_caching" in kernels) == (uvm in r["memory"])
        assert r["memory"]["device"] > 0
    # dcp.save of the emulated model's state_dict, loaded into the CPU layout: the same bits
    M.assert_same([r["roundtrip"] for r in ranks],
                  [{k: v for k, v in r["gpu"].items() if not k.startswith("state.")}
                   for r in ranks], f"{case} dcp round trip")


# ------------------------------------------------------------------------------------------
# Loads: another plan and other locations; device memory staged, UVM written in place
# ------------------------------------------------------------------------------------------

# saved by an eager CPU DMP (world 2); loaded into MIXED on the emulated GPU: RW->TW, TW->RW,
# CW->CW, RW->TWRW, DP->DP, TW->RW (UVM caching), RW->TW (UVM)
SAVED = {"t0": ("rw", "fused"), "t1": ("tw", "fused"), "t2": ("cw", "fused"),
         "t3": ("rw", "fused"), "t4": ("dp", "dense"), "t5": ("tw", "fused"),
         "t6": ("rw", "fused")}
UVM_TABLES = {n for n, (_, k) in M.MIXED.items() if k.startswith("fused_uvm")}


def worker_load(rank, world_size, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat
    import metamat.load.staged as staged
    from metamat.emulation import emulated_cuda

    module, sharder, plan, _ = M.build("ebc", SAVED, world_size, device_type="cpu")
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    eager = DistributedModelParallel(module, env, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])
    M.backward(eager, M.batch(len(SAVED), seed=10 + rank))  # momentum != 0
    path = os.path.join(tmp, "full")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=path)
    staged_fqns = []
    real = staged.execute_plan_staged

    def spy(plan, *a, **k):  # the real pipeline runs; only what went through it is noted
        staged_fqns.extend(t.fqn for t in plan.targets)
        return real(plan, *a, **k)

    staged.execute_plan_staged = spy
    module, sharder, plan, _ = M.build("ebc", M.MIXED, world_size)
    gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    with emulated_cuda():
        report = metamat.materialize(gpu, path)
    staged.execute_plan_staged = real
    return dict(saved=_state(eager), loaded=_state(gpu), staged=sorted(set(staged_fqns)),
                initialized=report.initialized, memory=report.bytes_by_memory)


@pytest.mark.multiprocess
def test_load_other_plan_and_locations_world2(tmp_path):
    ranks = run_dist(worker_load, 2, str(tmp_path))
    saved, loaded = [r["saved"] for r in ranks], [r["loaded"] for r in ranks]
    M.assert_same(saved, loaded, "load")  # tables, DP table, row-wise momentum: saved bits
    assert all(r["initialized"] == [] for r in ranks)
    staged = {k for r in ranks for k in r["staged"]}
    table = {k.split(".")[-2] for k in staged if k.endswith(".weight")}
    # device memory through the staging ring; UVM tables written from the host, in place
    assert table == {"t0", "t3", "t4"} - set() and not table & UVM_TABLES, table
    assert any(k.startswith("state.") for k in staged)  # row-wise momentum: device memory


# ------------------------------------------------------------------------------------------
# A live model's LXU cache: written back before a load, emptied after it
# ------------------------------------------------------------------------------------------

CACHED = {"t0": ("tw", "fused_uvm_caching"), "t1": ("tw", "fused_uvm_caching")}


def _cached_tbe(model):
    return next(w._emb_module for w in M.wrappers(model)
                if w._emb_module.lxu_cache_weights.numel())


def _warm_cache(emb, value: float):
    """What training leaves in the cache: rows 0 and 3 of both tables cached, their cached
    values newer than the rows in UVM. Returns {(table, row): cached row}."""
    cumsum = emb.cache_hash_size_cumsum.tolist()
    dims = (emb.D_offsets[1:] - emb.D_offsets[:-1]).tolist()
    out, slot = {}, 0
    with torch.no_grad():
        for t in (0, 1):
            for r in (0, 3):
                emb.lxu_cache_state.view(-1)[slot] = cumsum[t] + r
                row = torch.full((dims[t],), value + 10 * t + r)
                emb.lxu_cache_weights[slot, :dims[t]] = row
                out[(t, r)] = row
                slot += 1
    return out


def worker_cache(rank, world_size, tmp):
    import torch.distributed.checkpoint as dcp

    import metamat
    from metamat.emulation import emulated_cuda

    # the checkpoint holds t0 only: t1 keeps its values, the trained rows in the cache included
    module, sharder, plan, _ = M.build("ebc", M.cpu_layout(CACHED), 1, device_type="cpu")
    cpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
    metamat.materialize(cpu, device="cpu", seed=1)
    t0 = {k: v for k, v in cpu.state_dict().items() if ".t0." in k}
    path = os.path.join(tmp, "t0")
    dcp.save(t0, checkpoint_id=path)
    want_t0 = t0["embedding_bags.t0.weight"].local_shards()[0].tensor.clone()
    module, sharder, plan, _ = M.build("ebc", CACHED, 1)
    gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    out = {}
    with emulated_cuda():
        metamat.materialize(gpu, seed=2)
        emb = _cached_tbe(gpu)
        for mode in ("shadow", "inplace"):
            t1_before = gpu.state_dict()["embedding_bags.t1.weight"].local_shards()[0] \
                .tensor.clone()  # state_dict() writes the cache back: every row's value
            emb.lxu_cache_state.fill_(-1)
            cached = _warm_cache(emb, 100.0)
            metamat.materialize(gpu, path, strict=False, inplace=mode == "inplace")
            sd = gpu.state_dict()  # writes back whatever the cache still holds
            got_t0 = sd["embedding_bags.t0.weight"].local_shards()[0].tensor
            got_t1 = sd["embedding_bags.t1.weight"].local_shards()[0].tensor
            want_t1 = t1_before.clone()
            for (t, r), row in cached.items():
                if t == 1:
                    want_t1[r] = row  # trained in the cache only: kept
            out[mode] = dict(empty=bool((emb.lxu_cache_state == -1).all()),
                             t0=torch.equal(got_t0, want_t0), t1=torch.equal(got_t1, want_t1))
        # a damaged checkpoint: named error, the model (cache included) as it was
        import shutil

        bad = os.path.join(tmp, "bad")
        shutil.copytree(path, bad)
        data = next(os.path.join(bad, f) for f in os.listdir(bad) if f.endswith(".distcp"))
        os.truncate(data, os.path.getsize(data) // 2)
        _warm_cache(emb, 500.0)
        state, weights = emb.lxu_cache_state.clone(), emb.lxu_cache_weights.clone()
        before = _state(gpu)
        try:
            metamat.materialize(gpu, bad, strict=False)
        except metamat.CheckpointError as e:
            out["bad"] = type(e).__name__
        out["bad_unchanged"] = torch.equal(state, emb.lxu_cache_state) and torch.equal(
            weights, emb.lxu_cache_weights) and all(
            torch.equal(a, b) for k in before for (_, a), (_, b) in zip(before[k], _state(gpu)[k]))
    return out


def test_live_cache_written_back_before_and_emptied_after_a_load(tmp_path):
    out = run_dist(worker_cache, 1, str(tmp_path))[0]
    for mode in ("shadow", "inplace"):
        assert out[mode] == dict(empty=True, t0=True, t1=True), (mode, out[mode])
    assert out.get("bad") and out["bad_unchanged"], out


# ------------------------------------------------------------------------------------------
# Refusals: nothing allocated, the model as it was
# ------------------------------------------------------------------------------------------

def worker_refusals(rank, world_size):
    import metamat
    from metamat.emulation import emulated_cuda

    out = {}
    module, sharder, plan, _ = M.build("ebc", M.MIXED, 1)
    gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    try:
        with emulated_cuda(free_memory=4096):  # the caches alone take more
            metamat.materialize(gpu, seed=1)
    except metamat.DeviceMemoryError as e:
        out["memory"] = str(e)
    out["memory_meta"] = all(t.is_meta for t in gpu.parameters())
    # an eager DMP on the CPU: its tables hold values in fbgemm's CPU layout
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    module, sharder, plan, _ = M.build("ebc", M.cpu_layout(M.MIXED), 1, device_type="cpu")
    eager = DistributedModelParallel(module, ShardingEnv.from_process_group(dist.group.WORLD),
                                     device=torch.device("cpu"), plan=plan, sharders=[sharder])
    before = _state(eager)
    try:
        with emulated_cuda():
            metamat.materialize(eager, device="cuda", seed=1)
    except metamat.UnsupportedError as e:
        out["layout"] = str(e)
    after = _state(eager)
    out["layout_unchanged"] = all(torch.equal(a, b) for k in before
                                  for (_, a), (_, b) in zip(before[k], after[k]))
    return out


def test_refused_before_allocating():
    out = run_dist(worker_refusals, 1)[0]
    assert "LXU caches" in out["memory"] and "cache_sets=" in out["memory"], out["memory"]
    assert "nothing was allocated" in out["memory"] and out["memory_meta"]
    assert "CPU kernels" in out["layout"] and "hold values" in out["layout"], out["layout"]
    assert out["layout_unchanged"]


def worker_relayout(rank, world_size):
    """TorchRec's own DMP on meta (fbgemm's CPU layout) materialized on the GPU: its
    collections are sharded again for the CUDA layout; a failure puts the old ones back."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat
    from metamat.emulation import emulated_cuda

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    # (a DLRM fails in TorchRec's own DDP wrap on meta: "param must be a leaf tensor")
    module, sharder, plan, _ = M.build("ebc", M.MIXED, world_size)
    dmp = DistributedModelParallel(module, env, device=torch.device("meta"), plan=plan,
                                   sharders=[sharder], init_parameters=False)
    sparse, optim = dmp.module, dmp._optim
    out = {}
    try:
        with emulated_cuda(free_memory=4096):
            metamat.materialize(dmp, device="cuda", seed=SEED)
    except metamat.DeviceMemoryError:
        out["restored"] = dmp.module is sparse and dmp._optim is optim and \
            not hasattr(dmp, "_metamat_compute_device")
    with emulated_cuda():
        report = metamat.materialize(dmp, device="cuda", seed=SEED)
    out["memory"] = report.bytes_by_memory
    out["gpu"] = _state(dmp)
    out["buffers"] = M.fbgemm_mismatches(dmp)
    module, sharder, plan, _ = M.build("ebc", M.cpu_layout(M.MIXED), world_size,
                                       device_type="cpu")
    cpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
    metamat.materialize(cpu, device="cpu", seed=SEED)
    out["cpu"] = _state(cpu)
    return out


@pytest.mark.multiprocess
def test_torchrec_dmp_on_meta_is_laid_out_again_for_the_gpu():
    ranks = run_dist(worker_relayout, 2)
    assert all(r["restored"] for r in ranks)
    assert all("uvm" in r["memory"] and r["buffers"] == [] for r in ranks)
    M.assert_same([r["gpu"] for r in ranks], [r["cpu"] for r in ranks], "relayout")


def test_placements_name_each_ranks_gpu(monkeypatch):
    """Shard placements of a CUDA model: this rank's GPU; another rank's as that rank said at
    the fill agreement (with one visible GPU per process, rank 3 works on its cuda:0), else
    as the sharding plan placed it, else ``cuda:(rank % local world size)`` as TorchRec
    plans."""
    from types import SimpleNamespace

    from metamat.models.torchrec.register import rank_devices

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    plan = SimpleNamespace(device=torch.device("cuda", 2), peer_devices={})
    model = SimpleNamespace(_metamat_rank_devices={1: torch.device("cuda", 7),
                                                   3: torch.device("cuda", 3)})
    of = rank_devices(model, plan, me=2, world_size=8)
    assert [str(of(r)) for r in (2, 1, 5, 0, 3, None)] == \
        ["cuda:2", "cuda:7", "cuda:1", "cuda:0", "cuda:3", "cuda:2"]
    plan.peer_devices = {0: "cuda:0", 1: "cuda:1", 2: "cuda:2", 3: "cuda:0", 4: "cpu"}
    of = rank_devices(model, plan, me=2, world_size=8)
    assert [str(of(r)) for r in (2, 1, 5, 0, 3, 4)] == \
        ["cuda:2", "cuda:1", "cuda:1", "cuda:0", "cuda:0", "cuda:0"]
    of_cpu = rank_devices(model, SimpleNamespace(device=torch.device("cpu"), peer_devices={}), me=0,
                          world_size=8)
    assert str(of_cpu(5)) == "cpu"
