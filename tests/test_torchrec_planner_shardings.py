"""Plans made by TorchRec's own EmbeddingShardingPlanner, with the sharding types the
hand-written plans of the other tests do not make: table-column-wise (TWCW) and grid
(GRID_SHARD: row shards within a host, column blocks across hosts). Four gloo ranks stand for
two hosts of two.

* CPU: a TWCW table beside TW and CW ones materializes with the values of the reference
  (plan-invariant), trains one step exactly as an eager TorchRec DMP holding the same values,
  and its DCP checkpoint loads into a table-wise plan.
* Emulated GPU: grid (UVM caching), TWCW (UVM) and TW (device) tables laid out for CUDA get
  the CPU materialize's values and optimizer state, fbgemm's buffers, and load back on the CPU.
  (The grid case uses Adagrad: with row-wise Adagrad, a planner-made grid plan does not build
  on meta in TorchRec 1.9.2, its own DMP included: the ShardedTensor of the row-wise state
  fails torch's bounds check. TorchRec's planner offers grid for CUDA only.)
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

assert_same, fbgemm_mismatches = M.assert_same, M.fbgemm_mismatches

SEED = 13
TWCW_CPU = {"t0": ("table_column_wise", "fused"), "t1": ("table_wise", "fused"),
            "t2": ("column_wise", "fused")}
GRID_GPU = {"t0": ("grid_shard", "fused_uvm_caching"), "t1": ("table_column_wise", "fused_uvm"),
            "t2": ("table_wise", "fused")}
ALL_TW = {t: ("table_wise", "fused") for t in TWCW_CPU}


def _state(model) -> dict:
    out = M.local_blocks(model.state_dict())
    out.update(M.optimizer_blocks(model))
    return out


def _sharding_types(plan) -> dict:
    return {t: ps.sharding_type for t, ps in plan.plan[""].items()}


def _reload_table_wise(model, world_size, path, optimizer="EXACT_ROWWISE_ADAGRAD"):
    """``model``'s state_dict saved by DCP at ``path``, loaded into a table-wise CPU model;
    that model's local blocks."""
    import torch.distributed.checkpoint as dcp

    import metamat

    dcp.save(model.state_dict(), checkpoint_id=path)
    module, sharder, plan, _ = M.build_planned(ALL_TW, world_size, 2, device_type="cpu",
                                               optimizer=optimizer)
    back = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
    metamat.materialize(back, path, device="cpu")
    return M.local_blocks(back.state_dict())


def _step(model, batch):
    out = model(batch).wait().values()
    (out * out).sum().backward()
    return out.detach()


def worker_twcw_cpu(rank, world_size, tmp):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    module, sharder, plan, tables = M.build_planned(TWCW_CPU, world_size, 2, device_type="cpu")
    model = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
    metamat.materialize(model, device="cpu", seed=SEED)
    res = {"types": _sharding_types(plan), "init": _state(model)}
    eager = DistributedModelParallel(
        EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=plan, sharders=[sharder])
    eager.load_state_dict(model.state_dict())
    batch = M.batch(len(tables), seed=rank)
    res["out"], res["out_eager"] = _step(model, batch), _step(eager, batch)
    res["after"], res["after_eager"] = _state(model), _state(eager)
    res["reloaded"] = _reload_table_wise(model, world_size, os.path.join(tmp, "twcw"))
    return res


@pytest.mark.multiprocess
def test_table_column_wise_cpu_world4(tmp_path):
    ranks = run_dist(worker_twcw_cpu, 4, str(tmp_path))
    assert ranks[0]["types"] == {t: s for t, (s, _) in TWCW_CPU.items()}
    from test_torchrec_materialize import reference_table
    for i, t in enumerate(sorted(TWCW_CPU)):  # the reference values of each name and shape
        key = f"embedding_bags.{t}.weight"
        full = M.assemble([r["init"] for r in ranks], key, (M.rows_of(i), 64))
        want = reference_table(t, M.rows_of(i), 64, SEED)
        assert torch.equal(full, want), key
    for r in ranks:
        torch.testing.assert_close(r["out"], r["out_eager"], rtol=0, atol=0)
    assert_same([r["after"] for r in ranks], [r["after_eager"] for r in ranks], "after a step")
    saved = [{k: v for k, v in r["after"].items() if not k.startswith("state.")} for r in ranks]
    assert_same(saved, [r["reloaded"] for r in ranks], "TWCW -> TW load")  # the trained values


def worker_grid_emulated(rank, world_size, tmp):
    import metamat
    from metamat.emulation import emulated_cuda

    module, sharder, plan, _ = M.build_planned(GRID_GPU, world_size, 2,
                                               optimizer="EXACT_ADAGRAD")
    gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda")
    with emulated_cuda():
        report = metamat.materialize(gpu, seed=SEED)
    module, sharder, cplan, _ = M.build_planned(ALL_TW, world_size, 2, device_type="cpu",
                                                optimizer="EXACT_ADAGRAD")
    cpu = metamat.shard_on_meta(module, plan=cplan, sharders=[sharder])
    metamat.materialize(cpu, device="cpu", seed=SEED)
    res = dict(types=_sharding_types(plan), memory=report.bytes_by_memory, gpu=_state(gpu),
               cpu=_state(cpu), buffers=fbgemm_mismatches(gpu))
    res["roundtrip"] = _reload_table_wise(gpu, world_size, os.path.join(tmp, "grid"),
                                          "EXACT_ADAGRAD")
    return res


@pytest.mark.multiprocess
def test_grid_and_table_column_wise_emulated_gpu_world4(tmp_path):
    ranks = run_dist(worker_grid_emulated, 4, str(tmp_path))
    assert ranks[0]["types"] == {t: s for t, (s, _) in GRID_GPU.items()}
    gpu, cpu = [r["gpu"] for r in ranks], [r["cpu"] for r in ranks]
    assert_same(gpu, cpu, "grid/TWCW vs CPU")  # tables and Adagrad state, bit for bit
    assert all(r["buffers"] == [] for r in ranks), [r["buffers"] for r in ranks]
    assert all("uvm" in r["memory"] and r["memory"]["device"] > 0 for r in ranks)
    tables = [{k: v for k, v in r["gpu"].items() if not k.startswith("state.")} for r in ranks]
    assert_same([r["roundtrip"] for r in ranks], tables, "grid -> TW load")
