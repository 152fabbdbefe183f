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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16,
                                1: torch.uint8}[t.element_size()])


def _state(model) -> dict:
    out = M.local_blocks(model.state_dict())
    if hasattr(model, "fused_optimizer"):
        out.update(M.optimizer_blocks(model))
    return out


def fbgemm_mismatches(model) -> list:
    """Every buffer of each fused TBE (metadata, cache, counters, optimizer state) against
    the same TBE built for real by fbgemm-gpu-cpu on the CPU with the same CUDA specs; the
    weights excepted (their values are metamat's)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen as TBE)

    bad = []
    for w in M.wrappers(model):
        emb = w._emb_module
        if not isinstance(emb, TBE):
            continue
        cached = emb.lxu_cache_weights.numel() > 0
        cache = dict(cache_sets=emb.lxu_cache_state.shape[0] if cached else 1,
                     cache_precision=SparseType.from_dtype(emb.lxu_cache_weights.dtype))
        ref = TBE(list(emb.embedding_specs), feature_table_map=list(emb.feature_table_map),
                  optimizer=emb.optimizer, weights_precision=emb.weights_precision,
                  cache_algorithm=emb.cache_algorithm, uvm_host_mapped=emb.uvm_host_mapped,
                  device=torch.device("cpu"), pooling_mode=emb.pooling_mode, **cache)
        mine = dict(emb.named_buffers())
        for name, want in ref.named_buffers():
            have = mine.get(name)
            if name.startswith("weights_"):
                continue
            if have is None or have.shape != want.shape or have.dtype != want.dtype \
                    or not torch.equal(_bits(have.cpu()), _bits(want)):
                bad.append(name)
        for name, p in ref.named_parameters():  # momentum (zeros), empty weight buffers
            if not name.startswith("weights_") and not torch.equal(getattr(emb, name), p):
                bad.append(name)
    return bad


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
               cpu=_state(cpu), buffers=fbgemm_mismatches(gpu),
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


def _global(per_rank, key):
    blocks = [b for r in per_rank for b in r.get(key, [])]
    shape = [max(o[d] + t.shape[d] for o, t in blocks) for d in range(blocks[0][1].dim())]
    return M.assemble(per_rank, key, shape, dtype=blocks[0][1].dtype)


def assert_same(a_ranks, b_ranks, what: str, keys=None):
    keys = keys or sorted({k for r in a_ranks for k in r})
    assert keys, what
    for k in keys:
        a, b = _global(a_ranks, k), _global(b_ranks, k)
        assert a.shape == b.shape, f"{what} {k}: {a.shape} vs {b.shape}"
        assert not torch.isnan(a.float()).any(), f"{what} {k}: rows or columns not written"
        assert torch.equal(_bits(a), _bits(b)), f"{what} {k} differs"


CASES = {
    "ebc-mixed-world2": ("ebc", M.MIXED, {}, 2),
    "ec-world2": ("ec", M.MIXED_EC, {}, 2),
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
    ranks = run_dist(worker_init, world, kind, layout, _opts(opts), str(tmp_path))
    gpu, cpu = [r["gpu"] for r in ranks], [r["cpu"] for r in ranks]
    # every table, dense parameter and optimizer state: the CPU materialize's bits
    keys = None
    if opts.get("optimizer") in CPU_LACKS:
        keys = sorted({k for r in cpu for k in r if not k.startswith("state.")})
        state = [t for r in gpu for k, v in r.items() if k.startswith("state.") for _, t in v]
        assert len(state) >= 2 * len(layout) and all(not t.any() for t in state)
    assert_same(gpu, cpu, case, keys)
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
    assert_same([r["roundtrip"] for r in ranks],
                [{k: v for k, v in r["gpu"].items() if not k.startswith("state.")}
                 for r in ranks], f"{case} dcp round trip")
