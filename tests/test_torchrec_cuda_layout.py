"""TorchRec tables laid out for fbgemm's CUDA kernels, checked on CPU (issue 13, CPU part).

* fbgemm-gpu-cpu builds a TBE with CUDA-location specs on meta (cache_sets > 0) and for real
  on CPU; metamat's re-derived layout (cuda_layout) must equal both: placements, offsets,
  buffer sizes, and every metadata / cache buffer's initial value bit for bit.
* shard_on_meta(compute_device="cuda") builds the FUSED / FUSED_UVM / FUSED_UVM_CACHING kernels
  entirely on meta with that layout.
* Fill items of the tables, run through the emulated CUDA launch, give exactly metamat's CPU
  init of the same tables (a CPU materialize of the same model and plan).
* Unsupported kernels, versions, optimizers and locations raise before anything is built.
* GPU only (marked cuda, skipped here): UVM allocation with fbgemm's op, one-launch fill.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.models.torchrec import cuda_layout as cl  # noqa: E402
from metamat.models.torchrec.compat import UnsupportedError  # noqa: E402
from metamat.rules import default_table_dist  # noqa: E402

from _dist import run_dist  # noqa: E402
from conftest import bits  # noqa: E402

SEED = 11


def _fbgemm():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        CacheAlgorithm, ComputeDevice, EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation, ComputeDevice, EmbOptimType, \
        CacheAlgorithm


def make_tbe(device, locs=("DEVICE", "MANAGED", "MANAGED_CACHING", "DEVICE", "MANAGED_CACHING"),
             optimizer="EXACT_ROWWISE_ADAGRAD", algorithm="LRU", ftm=(0, 1, 2, 2, 3, 4),
             cache_sets=16, **kw):
    TBE, L, CD, O, CA = _fbgemm()
    rows = [1000, 500, 2000, 300, 700, 64][:len(locs)]
    dims = [64, 32, 16, 8, 16, 4][:len(locs)]
    specs = [(r, d, L[loc], CD.CUDA) for r, d, loc in zip(rows, dims, locs)]
    return TBE(specs, feature_table_map=list(ftm), optimizer=O[optimizer],
               cache_algorithm=CA[algorithm], cache_sets=cache_sets, device=torch.device(device),
               table_names=[f"tab{i}" for i in range(len(locs))], **kw)


CASES = [
    dict(),
    dict(algorithm="LFU"),
    dict(optimizer="EXACT_ADAGRAD"),
    dict(optimizer="EXACT_ADAGRAD", uvm_non_rowwise_momentum=True),
    dict(optimizer="EXACT_SGD"),
    dict(optimizer="ADAM"),
    dict(optimizer="PARTIAL_ROWWISE_ADAM"),
    dict(optimizer="LAMB", uvm_non_rowwise_momentum=True),
    dict(locs=("DEVICE", "MANAGED"), ftm=(0, 1, 1, 0)),  # no cached table
    dict(locs=("MANAGED_CACHING",) * 3, ftm=(2, 0, 1, 0)),
    dict(locs=("DEVICE",) * 4, ftm=(0, 1, 2, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
                         or "default")
def test_layout_equals_fbgemm_on_meta_and_on_cpu(case):
    meta = make_tbe("meta", **case)
    real = make_tbe("cpu", **case)  # fbgemm-gpu-cpu builds the CUDA layout for real on CPU
    assert meta.weights_dev.device.type == "meta" and meta.weights_uvm.device.type == "meta"
    lm, lr = cl.tbe_layout(meta), cl.tbe_layout(real)
    assert lm == lr
    # every metadata and cache buffer: metamat's value == what fbgemm's constructor set
    values = cl.initial_values(lm)
    for name, v in values.items():
        have = getattr(real, name)
        assert have.dtype == v.dtype and have.shape == v.shape, name
        assert torch.equal(have, v), name
        assert getattr(meta, name).shape == v.shape and getattr(meta, name).dtype == v.dtype
    # every table view fbgemm hands out lies where the layout says
    for t, w in enumerate(real.split_embedding_weights()):
        buf = getattr(real, lm.weights.storage(t))
        assert w.data_ptr() == buf.data_ptr() + lm.weights.offsets[t] * buf.element_size()
        assert tuple(w.shape) == (lm.rows[t], lm.dims[t])
    for prefix, s in lm.states.items():
        for t in range(len(lm.rows)):
            buf = getattr(real, s.storage(t))
            assert s.offsets[t] + lm.rows[t] * s.row_elems[t] <= buf.numel()
    # optimizer state is born zero, as metamat leaves it
    for prefix in lm.states:
        for st in ("dev", "uvm"):
            assert not getattr(real, f"{prefix}_{st}").any()


def test_cache_state_matches_fbgemm_function():
    # the free function exists in fbgemm 1.6 and (as a shim over CacheState.construct) 1.8
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation, construct_cache_state,
    )

    rows, locs, ftm = [10, 7, 5, 9], ["MANAGED_CACHING", "DEVICE", "MANAGED_CACHING",
                                      "MANAGED_CACHING"], [0, 1, 2, 0, 3, 2]
    want = construct_cache_state(rows, [EmbeddingLocation[x] for x in locs], ftm)
    got = cl.cache_state(rows, locs, ftm)
    assert got == (want.cache_hash_size_cumsum, want.cache_index_table_map,
                   want.total_cache_hash_size)


def test_cache_sets_formula():
    from metamat.models.torchrec.cuda_kernels import cache_sets_for

    locs = ["MANAGED_CACHING", "DEVICE", "MANAGED_CACHING"]
    assert cache_sets_for([1000, 10**6, 600], [8, 8, 16], locs, 0.2, 4) == (320 + 31) // 32
    assert cache_sets_for([10, 5, 5], [8, 8, 16], locs, 0.2, 4) == 1
    assert cache_sets_for([10, 5], [8, 8], ["DEVICE", "MANAGED"], 0.2, 4) == 0
    # capped by free memory: 16 columns * 4 bytes * 32 slots = 2 KiB per set
    assert cache_sets_for([10**6, 0, 10**6], [8, 8, 16], locs, 0.5, 4, free_memory=4096) == 2


@pytest.mark.parametrize("case", [dict(optimizer="LARS_SGD"), dict(weights_precision="INT8")])
def test_unsupported_tbe_refused(case):
    from fbgemm_gpu.split_embedding_configs import SparseType

    if "weights_precision" in case:
        case = dict(weights_precision=SparseType.INT8, cache_precision=SparseType.FP32,
                    optimizer="EXACT_SGD")
    tbe = make_tbe("meta", **case)
    with pytest.raises(UnsupportedError):
        cl.tbe_layout(tbe)


def test_cpu_layout_tbe_refused():
    TBE, L, CD, O, _ = _fbgemm()
    tbe = TBE([(10, 8, L.HOST, CD.CPU)], optimizer=O.EXACT_ROWWISE_ADAGRAD,
              device=torch.device("meta"))
    with pytest.raises(UnsupportedError, match="not a CUDA layout"):
        cl.tbe_layout(tbe)


# ------------------------------------------------------------------------------------------
# Through TorchRec: shard_on_meta(compute_device="cuda") in a gloo world of one
# ------------------------------------------------------------------------------------------

KERNELS = {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm"), "t2": ("cw", "fused_uvm_caching"),
           "t3": ("tw", "fused"), "t4": ("rw", "fused")}


def _model_and_plan(kernels, world_size=1, device_type="cuda"):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, row_wise, table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8 * (i % 3 + 1),
                                 num_embeddings=40 + 7 * i, feature_names=[f"f{i}"])
              for i in range(len(kernels))]
    module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    gen = {"tw": lambda: table_wise(rank=0), "rw": row_wise,
           "cw": lambda: column_wise(ranks=[0, 0])}
    mp = construct_module_sharding_plan(
        module, {t: gen[k]() for t, (k, _) in kernels.items()}, local_size=world_size,
        world_size=world_size, device_type=device_type, sharder=sharder)
    for t, ps in mp.items():
        ps.compute_kernel = kernels[t][1]
    return module, sharder, ShardingPlan({"": mp}), tables


def _fused_wrappers(dmp):
    out = []
    for lookup in dmp.module._lookups:
        out.extend(lookup._emb_modules)
    return out


def worker_cuda_layout(rank, world_size):
    import torchrec.distributed.batched_embedding_kernel as bek
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    module, sharder, plan, tables = _model_and_plan(KERNELS)
    dmp = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    assert bek.SplitTableBatchedEmbeddingBagsCodegen is SplitTableBatchedEmbeddingBagsCodegen
    real = [n for n, t in list(dmp.named_parameters()) + list(dmp.named_buffers())
            if t.device.type != "meta"]
    assert not real, real
    seen = {}
    storages_nbytes = 0
    for w in _fused_wrappers(dmp):
        emb = w._emb_module
        names = [t.name for t in w._config.embedding_tables]
        lay = cl.tbe_layout(emb, names)
        for n, loc in zip(names, lay.locations):
            seen.setdefault(n, set()).add(loc)
        for name, tensor in list(emb.named_buffers()) + list(emb.named_parameters()):
            # floating storages all on meta (fbgemm keeps the int64 feature_dims on CPU)
            assert tensor.device.type == "meta" or not tensor.is_floating_point(), name
            if name.startswith(("weights_", "momentum1_")) and tensor.is_floating_point():
                storages_nbytes += tensor.numel() * tensor.element_size()
        if lay.cache is not None:
            assert tuple(emb.lxu_cache_state.shape) == (lay.cache.cache_sets, lay.cache.assoc)
    # the state_dict and the fused optimizer work on meta (flush is a no-op there)
    sd = dmp.state_dict()
    osd = dmp.fused_optimizer.state_dict()
    return {k: sorted(v) for k, v in seen.items()}, sorted(sd), len(osd["state"]), storages_nbytes


def test_shard_on_meta_builds_cuda_kernels_on_meta():
    seen, keys, n_state, nbytes = run_dist(worker_cuda_layout, 1)[0]
    assert seen == {"t0": ["DEVICE"], "t1": ["MANAGED"], "t2": ["MANAGED_CACHING"],
                    "t3": ["DEVICE"], "t4": ["DEVICE"]}
    assert keys == [f"embedding_bags.t{i}.weight" for i in range(5)]
    assert n_state == 5 and nbytes > 0


def worker_fill_vs_cpu_init(rank, world_size):
    """(fill items of the CUDA layout through the emulated launch == CPU fill_many_ ==
    metamat's CPU materialize of the same tables, per table)."""
    from metamat._ext import core
    from metamat.init import _pack

    module, sharder, plan, tables = _model_and_plan(KERNELS)
    dmp = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    rows_of = {t.name: t.num_embeddings for t in tables}
    results = []
    for w in _fused_wrappers(dmp):
        cfgs = list(w._config.embedding_tables)
        lay = cl.tbe_layout(w._emb_module, [t.name for t in cfgs])
        items = cl.fill_items(lay, [tuple(t.local_metadata.shard_offsets) for t in cfgs],
                              lambda n: default_table_dist(rows_of[n]), SEED,
                              locations=("DEVICE", "MANAGED", "MANAGED_CACHING"))
        # CPU stand-ins for the GPU storages, NaN-poisoned
        bufs = [{s: torch.full((lay.weights.size("_" + s.rsplit("_", 1)[1]),), float("nan"))
                 for s in ("weights_dev", "weights_uvm")} for _ in range(2)]
        emulated = cl.fill_many_items(items, bufs[0])
        segs = _pack(emulated, SEED)
        core().fill_cuda_emulated(segs.ctypes.data, len(segs), False)
        metamat.fill_many_(cl.fill_many_items(items, bufs[1]), seed=SEED)
        for it, (view, *_) in zip(items, emulated):
            results.append((it.key, it.row_offset, it.col_offset, it.storage, it.offset,
                            view.clone()))
        for s in bufs[0]:
            assert torch.equal(bits(bufs[0][s]), bits(bufs[1][s])), s
            assert not torch.isnan(bufs[0][s]).any(), f"{s}: bytes no item covers"
    # metamat's CPU init of the same model and plan (kernels: fused, CPU layout)
    cpu_kernels = {t: (k, "fused") for t, (k, _) in KERNELS.items()}
    module, sharder, plan, _ = _model_and_plan(cpu_kernels, device_type="cpu")
    cpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
    metamat.materialize(cpu, device="cpu", seed=SEED)
    blocks = {}
    for k, v in cpu.state_dict().items():
        for s in v.local_shards():
            blocks[(k.split(".")[-2], *s.metadata.shard_offsets)] = s.tensor.detach().clone()
    out = []
    for key, ro, co, storage, off, view in results:
        ref = blocks[(key, ro, co)]
        out.append((key, storage, off, torch.equal(bits(ref), bits(view))))
    return out


def test_fill_items_emulated_launch_equals_cpu_init():
    out = run_dist(worker_fill_vs_cpu_init, 1)[0]
    assert {k for k, *_ in out} == {f"t{i}" for i in range(5)}
    assert {s for _, s, *_ in out} == {"weights_dev", "weights_uvm"}
    assert all(ok for *_, ok in out), out


def worker_refused(rank, world_size, what):
    import torchrec
    import torchrec.distributed.batched_embedding_kernel as bek
    import torchrec.distributed.model_parallel as mpar
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    built = []
    real_dmp = mpar.DistributedModelParallel

    class Spy(real_dmp):
        def __init__(self, *a, **k):
            built.append(1)
            super().__init__(*a, **k)

    mpar.DistributedModelParallel = Spy
    kernels = dict(KERNELS)
    if what == "key_value":
        kernels["t3"] = ("tw", "key_value")
    module, sharder, plan, _ = _model_and_plan(kernels)
    if what == "version":
        torchrec.__version__ = "1.5.0"
    try:
        metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    except UnsupportedError as e:
        msg = str(e)
    else:
        msg = None
    assert bek.SplitTableBatchedEmbeddingBagsCodegen is SplitTableBatchedEmbeddingBagsCodegen
    params_meta = all(p.device.type == "meta" for p in module.parameters())
    return msg, built, params_meta


@pytest.mark.parametrize("what,match", [("key_value", "t3 .*kernel 'key_value'"),
                                        ("version", "torchrec 1.5.0 is not supported")])
def test_refused_before_anything_is_built(what, match):
    import re

    msg, built, params_meta = run_dist(worker_refused, 1, what)[0]
    assert msg is not None and re.search(match, msg), msg
    assert built == [] and params_meta


# ------------------------------------------------------------------------------------------
# GPU only: UVM allocation with fbgemm's op and the one-launch fill (skipped without a GPU)
# ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("host_mapped", [False, True])
def test_allocate_and_fill_on_gpu(host_mapped):
    tbe = make_tbe("meta", uvm_host_mapped=host_mapped)
    lay = cl.tbe_layout(tbe)
    assert lay.uvm_host_mapped is host_mapped
    dev = torch.device("cuda", torch.cuda.current_device())
    st = cl.allocate_storages(lay, dev)
    assert torch.ops.fbgemm.is_uvm_tensor(st["weights_uvm"])
    assert not torch.ops.fbgemm.is_uvm_tensor(st["weights_dev"])
    for name, v in cl.initial_values(lay).items():
        assert torch.equal(st[name].cpu(), v), name
    assert not st["momentum1_dev"].any()
    items = cl.fill_items(lay, [(0, 0)] * len(lay.rows), lambda n: metamat.Uniform(-0.1, 0.1),
                          SEED, locations=("DEVICE", "MANAGED", "MANAGED_CACHING"))
    metamat.fill_many_(cl.fill_many_items(items, st), seed=SEED)  # one launch for the device
    torch.cuda.synchronize()
    cpu = {k: torch.full((v.numel(),), float("nan")) for k, v in st.items()
           if k in ("weights_dev", "weights_uvm")}
    metamat.fill_many_(cl.fill_many_items(items, cpu), seed=SEED)
    for k, v in cpu.items():
        assert torch.equal(bits(st[k].cpu()), bits(v)), k


@pytest.mark.cuda
def test_cuda_sharded_tbe_layout_matches_fbgemm_on_gpu():
    """fbgemm (CUDA build) constructs the TBE on the GPU: metamat's values equal its buffers."""
    tbe = make_tbe(torch.device("cuda", torch.cuda.current_device()))
    lay = cl.tbe_layout(tbe)
    for name, v in cl.initial_values(lay).items():
        assert torch.equal(getattr(tbe, name).cpu(), v), name
    assert torch.ops.fbgemm.is_uvm_tensor(tbe.weights_uvm)


def worker_materialize_refused(rank, world_size):
    module, sharder, plan, _ = _model_and_plan(KERNELS)
    dmp = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    try:
        metamat.materialize(dmp, device="cpu", seed=SEED)
    except UnsupportedError as e:
        msg = str(e)
    else:
        msg = None
    still_meta = all(t.is_meta for t in dmp.parameters())
    return msg, still_meta


def test_materialize_of_cuda_layout_on_the_cpu_is_refused():
    msg, still_meta = run_dist(worker_materialize_refused, 1)[0]
    assert msg is not None and "laid out for cuda" in msg and "device='cuda'" in msg, msg
    assert still_meta
