"""metamat on real TorchRec: shard on meta, materialize, compare with eager TorchRec.

Runs in gloo process groups on CPU (world size 1 and 2), small tables.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.rules import default_table_dist  # noqa: E402

from _dist import run_dist  # noqa: E402
NUM_FEATURES_EBC = 5


def ebc_tables(prefix: str = "t", n: int = 5, dim: int = 8, rows: int = 40):
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"{prefix}{i}", embedding_dim=dim, num_embeddings=rows + 3 * i,
                               feature_names=[f"f{i}"]) for i in range(n)]


def ec_tables(n: int = 3, dim: int = 8, rows: int = 40):
    from torchrec import EmbeddingConfig

    return [EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows + 3 * i,
                            feature_names=[f"f{i}"]) for i in range(n)]


def fused_params():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


def sharding_gen(kind: str, world_size: int):
    from torchrec.distributed.sharding_plan import (
        column_wise, data_parallel, row_wise, table_row_wise, table_wise,
    )

    return {
        "tw": lambda: table_wise(rank=world_size - 1),
        "rw": lambda: row_wise(),
        "cw": lambda: column_wise(ranks=list(range(world_size)) if world_size > 1 else [0, 0]),
        "twrw": lambda: table_row_wise(host_index=0),
        "dp": lambda: data_parallel(),
    }[kind]()


def make_plan(module, kinds: Dict[str, str], kernel: str, world_size: int, sharder, path: str = ""):
    """ShardingPlan with explicit per-table sharding types and compute kernel."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    mp = construct_module_sharding_plan(
        module, {t: sharding_gen(k, world_size) for t, k in kinds.items()},
        local_size=world_size, world_size=world_size, device_type="cpu", sharder=sharder,
    )
    for _, ps in mp.items():
        if ps.sharding_type != "data_parallel":
            ps.compute_kernel = kernel
    return ShardingPlan({path: mp})


def local_blocks(state_dict) -> Dict[str, List[Tuple[Tuple[int, ...], torch.Tensor]]]:
    """state_dict -> {key: [(offsets, cpu clone)]} of the local blocks."""
    out = {}
    for k, v in state_dict.items():
        if hasattr(v, "local_shards"):
            out[k] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in v.local_shards()]
        elif isinstance(v, torch.Tensor):
            out[k] = [(tuple(0 for _ in v.shape), v.detach().clone())]
    return out


def assemble(per_rank: List[Dict[str, list]], key: str, shape) -> torch.Tensor:
    """Global tensor from every rank's local blocks (NaN where nothing was written)."""
    full = torch.full(shape, float("nan"))
    for blocks in per_rank:
        for off, t in blocks.get(key, []):
            idx = tuple(slice(o, o + s) for o, s in zip(off, t.shape))
            full[idx] = t
    return full


def reference_table(name: str, rows: int, dim: int, seed: int, dist=None) -> torch.Tensor:
    """The whole table as metamat fills it, computed on one unsharded tensor."""
    t = torch.empty(rows, dim)
    metamat.fill_(t, dist or default_table_dist(rows), seed=seed, key=name)
    return t


def kjt_batch(num_features: int, batch: int, rows: int, seed: int):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (num_features * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(num_features)], values=values, lengths=lengths)


def meta_bytes_of(model) -> Tuple[int, int]:
    """(bytes in meta storages, bytes in real storages of floating tensors) reachable."""
    from metamat.models.torchrec.graph import scan

    g = scan(model)
    meta, real, seen = 0, 0, set()
    for t in g.tensors():
        k = (t.device.type, t.untyped_storage()._cdata)
        if k in seen:
            continue
        seen.add(k)
        if t.device.type == "meta":
            meta += t.untyped_storage().nbytes()
        elif t.is_floating_point():
            real += t.untyped_storage().nbytes()
    return meta, real


def no_meta_left(model) -> List[str]:
    from metamat.models.torchrec.graph import scan

    g = scan(model)
    left = [g.path(t) for t in g.meta_tensors()]
    for obj in g.objects.values():
        if hasattr(obj, "local_shards") and isinstance(obj, torch.Tensor):
            for s in obj.local_shards():
                if s.tensor.device.type == "meta":
                    left.append(g.path(obj))
    return left


# --------------------------------------------------------------------------------------
# Workers (module level: spawned processes import this file)
# --------------------------------------------------------------------------------------

EBC_KINDS = {"t0": "tw", "t1": "rw", "t2": "cw", "t3": "twrw", "t4": "dp"}
EC_KINDS = {"t0": "tw", "t1": "rw", "t2": "cw"}
SEED = 7


def _build_sharded(rank, world_size, kind, kernel, kinds, *, via="metamat", device_str=False):
    """Return (dmp, sharder, plan, tables) for an EBC/EC sharded on meta."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    if kind == "ebc":
        tables = ebc_tables(n=len(kinds))
        meta = "meta" if device_str else torch.device("meta")
        module = EmbeddingBagCollection(tables=tables, device=meta)
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    else:
        tables = ec_tables(n=len(kinds))
        meta = "meta" if device_str else torch.device("meta")
        module = EmbeddingCollection(tables=tables, device=meta)
        sharder = EmbeddingCollectionSharder(fused_params=fused_params())
    kinds = {t.name: kinds[t.name] for t in tables if t.name in kinds}
    plan = make_plan(module, kinds, kernel, world_size, sharder)
    if via == "metamat":
        dmp = metamat_shard_on_meta(module, plan=plan, sharders=[sharder])
    else:
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        dmp = DistributedModelParallel(module, env, device=torch.device("meta"), plan=plan,
                                       sharders=[sharder], init_parameters=False)
    return dmp, sharder, plan, tables


def _eager_copy(kind, tables, sharder, plan, world_size, state_dict):
    """An eager TorchRec DMP (CPU) with the same plan, holding ``state_dict``'s values."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    cls = EmbeddingBagCollection if kind == "ebc" else EmbeddingCollection
    module = cls(tables=tables, device=torch.device("meta"))
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    eager = DistributedModelParallel(module, env, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])
    eager.load_state_dict(state_dict)
    return eager


def _output_tensor(out):
    if hasattr(out, "wait"):
        out = out.wait()
    if hasattr(out, "values") and callable(out.values) and not isinstance(out, dict):
        return out.values()
    # EC returns Dict[str, JaggedTensor]
    return torch.cat([out[k].values() for k in sorted(out.keys())])


def _step(model, batch):
    out = _output_tensor(model(batch))
    loss = (out * out).sum()
    loss.backward()
    return out.detach().clone()


def worker_sharded(rank, world_size, kind, kernel, kinds, via="metamat", device_str=False,
                   check_eager=True, ckpt_dir=None, step=True):
    """Shard on meta, check nothing allocated, materialize, check model state; returns
    local blocks and the results of a train step for comparisons in the parent."""
    dmp, sharder, plan, tables = _build_sharded(rank, world_size, kind, kernel, kinds, via=via,
                                                device_str=device_str)
    res = {}
    meta_b, real_b = meta_bytes_of(dmp)
    res["before_meta_bytes"], res["before_real_float_bytes"] = meta_b, real_b
    report = metamat_materialize(dmp, device="cpu", seed=SEED)
    res["report"] = str(report)
    res["bytes_written"] = report.bytes_written
    res["meta_left"] = no_meta_left(dmp)
    sd = dmp.state_dict()
    res["blocks"] = local_blocks(sd)
    res["optim_keys"] = sorted(dmp.fused_optimizer.state_dict()["state"].keys())
    # aliasing: state_dict shards, TableBatchedEmbeddingSlice views and TBE storage agree
    res["alias_ok"] = _aliasing_ok(dmp)
    if not step:
        return _save_and_reload(res, dmp, rank, world_size, kind, kinds, ckpt_dir)
    # train step vs eager TorchRec holding the same weights
    batch = kjt_batch(len(tables), batch=4, rows=40, seed=rank)
    if check_eager:
        eager = _eager_copy(kind, tables, sharder, plan, world_size, sd)
        out_e = _step(eager, batch)
    out_m = _step(dmp, batch)
    res["out"] = out_m
    if check_eager:
        res["out_eager"] = out_e
        res["after_m"] = local_blocks(dmp.state_dict())
        res["after_e"] = local_blocks(eager.state_dict())
        res["opt_m"] = _optim_blocks(dmp)
        res["opt_e"] = _optim_blocks(eager)
        if kernel == "dense":
            res["grads_m"] = _dense_grads(dmp)
            res["grads_e"] = _dense_grads(eager)
    if ckpt_dir is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dmp.state_dict(), checkpoint_id=ckpt_dir)
        res["saved"] = True
    return res


def _save_and_reload(res, dmp, rank, world_size, kind, kinds, ckpt_dir):
    """dcp.save the materialized model, load the checkpoint into a fresh meta model on the
    fused kernel (data-parallel tables stay dense) and keep its blocks in ``res["reloaded"]``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(dmp.state_dict(), checkpoint_id=ckpt_dir)
    fresh, *_ = _build_sharded(rank, world_size, kind, "fused", kinds)
    metamat_materialize(fresh, ckpt_dir, device="cpu")
    res["reloaded"] = local_blocks(fresh.state_dict())
    return res


def _optim_blocks(model):
    flat = {}
    for pfqn, states in model.fused_optimizer.state_dict()["state"].items():
        for name, v in states.items():
            flat[f"state.{pfqn}.{name}"] = v
    return local_blocks(flat)


def _dense_grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[n] = g.detach().clone()
    return out


def _aliasing_ok(dmp) -> List[str]:
    """Write a marker through each state_dict shard; see it in the TBE storage and
    through the module's embedding weight parameters. Returns failures."""
    failures = []
    sm = dmp.module
    with torch.no_grad():
        for k, v in dmp.state_dict().items():
            shards = [s.tensor for s in v.local_shards()] if hasattr(v, "local_shards") else [v]
            for t in shards:
                if t.numel() == 0:
                    continue
                old = t.flatten()[0].item()
                t.view(-1)[0] = 12345.0
                seen = any(
                    (12345.0 == w.view(-1)).any().item()
                    for lk in sm._lookups
                    for w in [getattr(lk, "module", lk)]
                    for e in w._emb_modules
                    for w2 in [getattr(e._emb_module, "weights_host", None),
                               getattr(e._emb_module, "weights", None)]
                    if isinstance(w2, torch.Tensor) and w2.numel() > 0
                    for w in [w2]
                )
                if not seen:
                    failures.append(f"{k}: shard write not visible in TBE storage")
                t.view(-1)[0] = old
    return failures


def worker_dlrm(rank, world_size):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.models.dlrm import DLRM
    from torchrec import EmbeddingBagCollection

    tables = ebc_tables(n=3, dim=8)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1], dense_device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    plan = make_plan(ebc, {"t0": "tw", "t1": "rw", "t2": "cw"}, "fused", world_size, sharder,
                     path="sparse_arch.embedding_bag_collection")
    dmp = metamat_shard_on_meta(model, plan=plan, sharders=[sharder])
    report = metamat_materialize(dmp, device="cpu", seed=SEED)
    left = no_meta_left(dmp)
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "embedding_bag" not in n], lr=0.05)
    losses = []
    for step in range(4):
        batch = kjt_batch(3, batch=8, rows=40, seed=step)
        dense = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step))
        logits = dmp(dense, batch).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(loss.item())
    dense_params = {n: p.detach().clone() for n, p in dmp.named_parameters() if "over_arch" in n}
    return {"left": left, "losses": losses, "report": str(report), "dense": dense_params}


class _NoReset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(3, device="meta"))


class _Wrapper(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.extra = _NoReset()


def worker_error(rank, world_size):
    """A meta parameter nobody can initialise: clear error, model left as it was."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from metamat import UnsupportedError

    ebc = EmbeddingBagCollection(tables=ebc_tables(n=2), device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    plan = make_plan(ebc, {"t0": "tw", "t1": "rw"}, "fused", world_size, sharder, path="ebc")
    dmp = metamat_shard_on_meta(_Wrapper(ebc), plan=plan, sharders=[sharder])
    before = meta_bytes_of(dmp)
    try:
        metamat_materialize(dmp, device="cpu")
    except UnsupportedError as e:
        msg = str(e)
    else:
        msg = None
    after = meta_bytes_of(dmp)
    ckpt_raised = False
    try:
        metamat_materialize(dmp, ckpt="x")  # a missing checkpoint: named error, nothing done
    except metamat.CheckpointError:
        ckpt_raised = True
    return {"msg": msg, "before": before, "after": after, "ckpt_raised": ckpt_raised}


def worker_gpu_host(rank, world_size, via):
    """Shard as on a machine with a GPU (``torch.cuda.is_available()`` True while the DMP is
    built; there is none here), then materialize on the CPU and train a step next to eager."""
    real_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        dmp, sharder, plan, tables = _build_sharded(rank, world_size, "ebc", "fused", EBC_KINDS,
                                                    via=via)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return {"build_error": f"{type(e).__name__}: {e}"}
    finally:
        torch.cuda.is_available = real_available
    res = {"before_meta_bytes": meta_bytes_of(dmp)}
    try:
        metamat_materialize(dmp, device="cpu", seed=SEED)
    except metamat.UnsupportedError as e:
        return {"materialize_error": str(e)}
    res["meta_left"] = no_meta_left(dmp)
    res["devices"] = sorted({str(t.device) for t in dmp.state_dict().values()
                             if isinstance(t, torch.Tensor)})
    batch = kjt_batch(len(tables), batch=4, rows=40, seed=rank)
    eager = _eager_copy("ebc", tables, sharder, plan, world_size, dmp.state_dict())
    res["out_eager"] = _step(eager, batch)
    res["out"] = _step(dmp, batch)
    return res


def metamat_shard_on_meta(*a, **k):
    from metamat import shard_on_meta

    return shard_on_meta(*a, **k)


def metamat_materialize(*a, **k):
    from metamat import materialize

    return materialize(*a, **k)


# --------------------------------------------------------------------------------------
# Checks in the parent
# --------------------------------------------------------------------------------------


def _check_tables(results, tables, seed=SEED):
    for t in tables:
        key = next(k for k in results[0]["blocks"] if k.endswith(f".{t.name}.weight"))
        full = assemble([r["blocks"] for r in results], key, (t.num_embeddings, t.embedding_dim))
        ref = reference_table(t.name, t.num_embeddings, t.embedding_dim, seed)
        assert not torch.isnan(full).any(), f"{key}: not every row/col written"
        assert torch.equal(full.view(torch.int32), ref.view(torch.int32)), f"{key}: differs from reference"


def _check_common(results, kernel):
    for r in results:
        assert r["meta_left"] == [], r["meta_left"]
        assert r["alias_ok"] == [], r["alias_ok"]
        # only scalars (fbgemm's learning-rate tensor) may be real before materialize
        assert r["before_real_float_bytes"] < 1024, r["before_real_float_bytes"]
        assert r["bytes_written"] > 0
        if "out_eager" in r:
            torch.testing.assert_close(r["out"], r["out_eager"], rtol=0, atol=0)
            for k in r["after_e"]:
                for (o1, a), (o2, b) in zip(r["after_m"][k], r["after_e"][k]):
                    assert o1 == o2
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{k} after step")
            assert r["opt_m"].keys() == r["opt_e"].keys()
            for k in r["opt_e"]:
                for (o1, a), (o2, b) in zip(r["opt_m"][k], r["opt_e"][k]):
                    assert o1 == o2
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{k} optimizer state")
            if kernel == "fused":
                assert r["opt_m"], "fused optimizer state missing"
            if kernel == "dense":
                assert r["grads_m"].keys() == r["grads_e"].keys()
                for k in r["grads_e"]:
                    torch.testing.assert_close(r["grads_m"][k], r["grads_e"][k])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_ebc_all_shardings_world2(kernel, tmp_path):
    res = run_dist(worker_sharded, 2, "ebc", kernel, EBC_KINDS, "metamat", False, True, str(tmp_path))
    _check_common(res, kernel)
    _check_tables(res, ebc_tables())
    # DP table: identical on both ranks, no broadcast needed
    dp_key = next(k for k in res[0]["blocks"] if k.endswith(".t4.weight"))
    assert torch.equal(res[0]["blocks"][dp_key][0][1], res[1]["blocks"][dp_key][0][1])
    keys = sorted(set(res[0]["optim_keys"]) | set(res[1]["optim_keys"]))
    assert keys == ([] if kernel == "dense" else [f"embedding_bags.t{i}.weight" for i in range(4)])
    assert (tmp_path / ".metadata").exists()


@pytest.mark.multiprocess
def test_ebc_world1_plan_invariance():
    # world 1: CW puts both column shards on rank 0, TWRW is a single row shard
    res = run_dist(worker_sharded, 1, "ebc", "fused", EBC_KINDS, "metamat", False, False)
    _check_common(res, "fused")
    _check_tables(res, ebc_tables())  # same reference as world 2 -> bit-identical tables


@pytest.mark.multiprocess
def test_ebc_all_rw_world2_plan_invariance():
    kinds = {f"t{i}": "rw" for i in range(5)}
    res = run_dist(worker_sharded, 2, "ebc", "fused", kinds, "metamat", False, False)
    _check_common(res, "fused")
    _check_tables(res, ebc_tables())


@pytest.mark.multiprocess
@pytest.mark.parametrize("device_str", [False, True], ids=["device_obj", "device_str"])
def test_ec_fused_world2(device_str):
    res = run_dist(worker_sharded, 2, "ec", "fused", EC_KINDS, "metamat", device_str, True)
    _check_common(res, "fused")
    _check_tables(res, ec_tables())


@pytest.mark.multiprocess
def test_ec_dense_kernel_world2(tmp_path):
    """EmbeddingCollection on TorchRec's DENSE kernel (BatchedDenseEmbedding: autograd
    weights, no fused optimizer), sharded and data-parallel: the fused kernel's values,
    saved by DCP and loaded back into a fused-kernel model. No train step on the CPU:
    fbgemm's CPU dense TBE pools sequence lookups (see the next test), so TorchRec's own
    eager model fails there too."""
    kinds = {**EC_KINDS, "t3": "dp"}
    res = run_dist(worker_sharded, 2, "ec", "dense", kinds, "metamat", False, False,
                   str(tmp_path), False)
    _check_common(res, "dense")
    _check_tables(res, ec_tables(n=4))
    dp_key = next(k for k in res[0]["blocks"] if k.endswith(".t3.weight"))
    assert torch.equal(res[0]["blocks"][dp_key][0][1], res[1]["blocks"][dp_key][0][1])
    assert res[0]["optim_keys"] == [] and res[1]["optim_keys"] == []
    for r in res:
        assert r["reloaded"].keys() == r["blocks"].keys()
        for k, blocks in r["blocks"].items():
            assert len(blocks) == len(r["reloaded"][k]), k
            for (o1, a), (o2, b) in zip(blocks, r["reloaded"][k]):
                assert o1 == o2 and torch.equal(a, b), k


def test_fbgemm_cpu_dense_tbe_still_pools_sequence_lookups():
    """Upstream bug that keeps the DENSE EmbeddingCollection from training on the CPU:
    fbgemm-gpu-cpu's DenseTableBatchedEmbeddingBagsCodegen ignores ``PoolingMode.NONE`` and
    returns one summed row per bag (TorchRec's eager DMP then corrupts the heap in its
    sequence all-to-all). When this fails, fbgemm has fixed it: give
    test_ec_dense_kernel_world2 its train step against eager TorchRec."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen)

    tbe = DenseTableBatchedEmbeddingBagsCodegen([(10, 4)], pooling_mode=PoolingMode.NONE,
                                                use_cpu=True)
    indices, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 5])
    out = tbe(indices, offsets).detach()
    rows = tbe.weights.detach().view(10, 4)
    assert out.shape == (2, 4)  # a sequence lookup would give (5, 4)
    torch.testing.assert_close(out, torch.stack([rows[1:3].sum(0), rows[3:6].sum(0)]))


@pytest.mark.multiprocess
def test_gpu_host_keeps_data_parallel_tables_on_meta():
    """TorchRec builds data-parallel tables for real on the GPU when one is visible, even for
    a DMP on meta (``use_cpu`` from ``torch.cuda.is_available()``); shard_on_meta keeps them
    on meta, so they materialize on the CPU like every other table."""
    (r,) = run_dist(worker_gpu_host, 1, "metamat")
    assert "build_error" not in r, r.get("build_error")
    assert r["meta_left"] == [] and r["devices"] == ["cpu"], r
    meta_b, real_b = r["before_meta_bytes"]
    assert meta_b > 0 and real_b < 1024, r["before_meta_bytes"]  # the DP table was on meta
    torch.testing.assert_close(r["out"], r["out_eager"], rtol=0, atol=0)
    # the same DMP built by TorchRec alone asks for the GPU: here there is none; on a GPU
    # host the table is real on it and materialize refuses it before writing anything
    (r,) = run_dist(worker_gpu_host, 1, "dmp")
    if torch.cuda.is_available():
        assert "allocated this table block on cuda" in r.get("materialize_error", ""), r
    else:  # a CPU build of torch: "not compiled with CUDA"; a CUDA build: "no NVIDIA driver"
        err = r.get("build_error", "")
        assert "CUDA" in err or "NVIDIA driver" in err, r


@pytest.mark.multiprocess
def test_plain_dmp_on_meta_world2():
    """A DMP the user built with device=meta, init_parameters=False (fused TW/RW/CW/TWRW;
    its DP table DMP puts on CPU is refilled in place with the plan-invariant values)."""
    if torch.cuda.is_available():
        # TorchRec puts that DP table on the GPU (host_kernels.py): refused, nothing written
        with pytest.raises(RuntimeError, match="allocated this table block on cuda"):
            run_dist(worker_sharded, 2, "ebc", "fused", EBC_KINDS, "dmp", False, True)
        return
    res = run_dist(worker_sharded, 2, "ebc", "fused", EBC_KINDS, "dmp", False, True)
    for r in res:
        assert r["meta_left"] == [], r["meta_left"]
        assert r["alias_ok"] == [], r["alias_ok"]
        torch.testing.assert_close(r["out"], r["out_eager"], rtol=0, atol=0)
    _check_tables(res, ebc_tables())


@pytest.mark.multiprocess
def test_dlrm_trains_world2():
    res = run_dist(worker_dlrm, 2)
    for r in res:
        assert r["left"] == []
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
    # dense params: same on both ranks (seeded reset_parameters + DDP)
    for k in res[0]["dense"]:
        torch.testing.assert_close(res[0]["dense"][k], res[1]["dense"][k])


@pytest.mark.multiprocess
def test_unsupported_leaves_model_unchanged():
    (r,) = run_dist(worker_error, 1)
    assert r["msg"] is not None and "extra.w" in r["msg"] and "reset_parameters" in r["msg"]
    assert r["before"] == r["after"]
    assert r["ckpt_raised"]


def _custom_init(t):
    with torch.no_grad():
        t.fill_(3.0)


def worker_init_options(rank, world_size):
    import functools
    import warnings

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from metamat.spec import Constant

    inits = {
        "t0": functools.partial(torch.nn.init.normal_, mean=0.1, std=0.02),
        "t1": _custom_init,
        "t2": None,  # overridden by init= below
        "t3": functools.partial(torch.nn.init.trunc_normal_, std=0.5, a=-0.4, b=0.4),
    }
    tables = [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=40 + i,
                                 feature_names=[f"f{i}"], init_fn=fn)
              for i, (n, fn) in enumerate(inits.items())]
    ebc = EmbeddingBagCollection(tables=tables, device="meta")
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    plan = make_plan(ebc, {"t0": "rw", "t1": "cw", "t2": "tw", "t3": "twrw"}, "fused", world_size, sharder)
    dmp = metamat_shard_on_meta(ebc, plan=plan, sharders=[sharder])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = metamat_materialize(dmp, device="cpu", seed=SEED, init={"t2": Constant(0.5)})
    msgs = [str(w.message) for w in caught if "init_fn" in str(w.message)]
    return {"blocks": local_blocks(dmp.state_dict()), "warnings": msgs, "report_warnings": report.warnings}


@pytest.mark.multiprocess
def test_table_init_fns_and_overrides_world2():
    from metamat.spec import Constant, Normal, TruncatedNormal

    res = run_dist(worker_init_options, 2)
    dists = {"t0": Normal(0.1, 0.02), "t2": Constant(0.5), "t3": TruncatedNormal(0.0, 0.5, -0.4, 0.4)}
    for i, name in enumerate(["t0", "t1", "t2", "t3"]):
        rows = 40 + i
        full = assemble([r["blocks"] for r in res], f"embedding_bags.{name}.weight", (rows, 8))
        assert not torch.isnan(full).any()
        if name == "t1":
            assert torch.equal(full, torch.full((rows, 8), 3.0))
        else:
            ref = reference_table(name, rows, 8, SEED, dists[name])
            assert torch.equal(full, ref), name
    for r in res:
        assert len(r["warnings"]) == 1 and "'t1'" in r["warnings"][0]


def worker_topology_groups(rank, world_size, pod):
    """TWRW tables placed on nodes of one rank (LOCAL_WORLD_SIZE=1) while TorchRec's topology
    groups span ``pod`` hosts (torchrec 1.6: TOPOLOGY_DOMAIN_MULTIPLE, 1.8+:
    TORCHREC_RESOLVED_POD_SIZE)."""
    import os

    from metamat import UnsupportedError

    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_row_wise)
    from torchrec.distributed.types import ShardingPlan

    os.environ.update(LOCAL_WORLD_SIZE="1", TOPOLOGY_DOMAIN_MULTIPLE=str(pod),
                      TORCHREC_RESOLVED_POD_SIZE=str(pod))
    ebc = EmbeddingBagCollection(tables=ebc_tables(n=2), device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    mp = construct_module_sharding_plan(  # two hosts of one rank: t0 on host 1's rank
        ebc, {"t0": table_row_wise(host_index=1), "t1": row_wise()}, local_size=1,
        world_size=world_size, device_type="cpu", sharder=sharder)
    for ps in mp.values():
        ps.compute_kernel = "fused"
    dmp = metamat_shard_on_meta(ebc, plan=ShardingPlan({"": mp}), sharders=[sharder])
    try:
        metamat_materialize(dmp, device="cpu", seed=SEED)
    except UnsupportedError as e:
        return str(e), all(p.is_meta for p in dmp.parameters())
    return "materialized", not any(p.is_meta for p in dmp.parameters())


@pytest.mark.multiprocess
def test_twrw_node_groups_of_another_size_than_the_placement_are_refused():
    """On meta TorchRec places table-row-wise tables by the local world size; the node groups
    metamat creates at register take TorchRec's topology size. When they differ the model is
    refused before anything is allocated (it would disagree on which rank holds which rows);
    when they agree it materializes."""
    for why, meta in run_dist(worker_topology_groups, 2, 2):
        assert "<root>: its table-row-wise" in why and "placed on nodes of 1 rank (" in why \
            and "node groups would have 2" in why, why
        assert meta
    for what, real in run_dist(worker_topology_groups, 2, 1):
        assert what == "materialized" and real


def test_unsupported_versions_raise_before_allocating(monkeypatch):
    import torchrec

    from metamat import materialize
    from metamat import shard_on_meta
    from metamat import UnsupportedError

    monkeypatch.setattr(torchrec, "__version__", "0.3.0", raising=False)
    lin = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(UnsupportedError, match="torchrec 0.3.0"):
        shard_on_meta(lin, env=object())
    # a model without TorchRec modules does not depend on torchrec's version
    materialize(lin, device="cpu")
    assert lin.weight.device.type == "cpu"
    # the TorchRec adapter checks before anything is planned or allocated
    from metamat.models.torchrec.walk import build_plan
    with pytest.raises(UnsupportedError, match="torchrec 0.3.0"):
        build_plan(lin, torch.device("cpu"))


def test_dist_from_init_fn():
    import functools

    from metamat.spec import Constant, Normal, TruncatedNormal, Uniform, Zeros
    from metamat.rules import dist_from_init_fn

    P = functools.partial
    assert dist_from_init_fn(P(torch.nn.init.uniform_, a=-1.0, b=2.0)) == Uniform(-1.0, 2.0)
    assert dist_from_init_fn(P(torch.nn.init.uniform_, b=0.5)) == Uniform(0.0, 0.5)
    assert dist_from_init_fn(P(torch.nn.init.normal_, 0.0, 0.1)) == Normal(0.0, 0.1)
    assert dist_from_init_fn(P(torch.nn.init.trunc_normal_, std=0.2)) == TruncatedNormal(0.0, 0.2, -2.0, 2.0)
    assert dist_from_init_fn(P(torch.nn.init.constant_, val=0.25)) == Constant(0.25)
    assert dist_from_init_fn(P(torch.nn.init.constant_, val=0.0)) == Zeros()
    assert dist_from_init_fn(torch.nn.init.zeros_) == Zeros()
    assert dist_from_init_fn(P(torch.nn.init.xavier_uniform_)) is None
    assert dist_from_init_fn(P(torch.nn.init.uniform_, generator=torch.Generator())) is None
    assert dist_from_init_fn(lambda t: t) is None
    # the lookup by call: a second partial of the same call hits it, keyword order aside
    from metamat import rules

    first = P(torch.nn.init.uniform_, a=-0.25, b=0.75)
    assert dist_from_init_fn(first) == Uniform(-0.25, 0.75)
    assert (torch.nn.init.uniform_, (), (("a", -0.25), ("b", 0.75))) in rules._PARTIAL_DISTS
    assert dist_from_init_fn(P(torch.nn.init.uniform_, b=0.75, a=-0.25)) == Uniform(-0.25, 0.75)
    assert dist_from_init_fn(P(torch.nn.init.uniform_, a=-0.25, b=0.5)) == Uniform(-0.25, 0.5)
    gen = P(torch.nn.init.uniform_, generator=torch.Generator())
    assert dist_from_init_fn(gen) is None and dist_from_init_fn(gen) is None
    assert not any(any(k == "generator" for k, _ in key[2]) for key in rules._PARTIAL_DISTS)
    a = torch.tensor(-0.5)  # not a plain value: answered, never kept
    assert dist_from_init_fn(P(torch.nn.init.uniform_, a=a, b=0.5)) == Uniform(-0.5, 0.5)
    assert not any(v is a for key in rules._PARTIAL_DISTS for _, v in key[2])


def worker_cuda_refused(rank, world_size):
    from metamat import UnsupportedError

    dmp, *_ = _build_sharded(rank, world_size, "ebc", "fused", {"t0": "tw", "t1": "rw"})
    try:
        metamat_materialize(dmp, device="cuda")
    except UnsupportedError as e:
        return {"msg": str(e), "meta_bytes": meta_bytes_of(dmp)}
    return {"msg": None}


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where no GPU is visible")
def test_cuda_without_a_gpu_is_refused_before_allocating():
    (r,) = run_dist(worker_cuda_refused, 1)
    assert r["msg"] is not None and "sees no CUDA device" in r["msg"], r["msg"]
    assert r["meta_bytes"][1] < 1024  # nothing real allocated


def worker_no_plan(rank, world_size):
    """shard_on_meta without a plan runs TorchRec's planner, as DistributedModelParallel(model)
    does, for its default compute device: the CPU here, CUDA on a GPU host (where the H100
    run of stop 31 found an eager DMP planned for the CPU with another plan). On a GPU host
    the two ranks share one GPU, where an eager DMP cannot be built (DDP's gloo check of its
    data-parallel table fails, H200 run of stop 32): the plan is then compared with TorchRec's
    planner called as DMP's constructor calls it."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv
    from torchrec.distributed.comm import get_local_size

    tables = ebc_tables(n=4, rows=64)
    dmp = metamat_shard_on_meta(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
    metamat_materialize(dmp, device="cpu", seed=SEED)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    fresh = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if torch.cuda.is_available():
        planner = EmbeddingShardingPlanner(topology=Topology(
            local_world_size=get_local_size(env.world_size), world_size=env.world_size,
            compute_device="cuda"))
        want = planner.collective_plan(fresh, get_default_sharders(), env.process_group)
    else:
        want = DistributedModelParallel(fresh, env, device=torch.device("cpu")).plan
    return {"left": no_meta_left(dmp), "blocks": local_blocks(dmp.state_dict()),
            "same_plan": str(dmp.plan) == str(want)}


@pytest.mark.multiprocess
def test_shard_on_meta_without_a_plan_world2():
    res = run_dist(worker_no_plan, 2)
    assert all(not r["left"] and r["same_plan"] for r in res), res
    for i in range(4):
        key, rows = f"embedding_bags.t{i}.weight", 64 + 3 * i
        assert torch.equal(assemble([r["blocks"] for r in res], key, (rows, 8)),
                           reference_table(f"t{i}", rows, 8, SEED)), key


def test_unsharded_collection_tables_get_torchrec_init():
    """An EmbeddingBagCollection used as a plain module on meta: each table its config's
    init (TorchRec's default, a known distribution fused, a callable as is), keyed by the
    table's name: the values the same table gets sharded (not nn.EmbeddingBag's N(0, 1))."""
    import functools

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    def ones(t):
        with torch.no_grad():
            t.fill_(1.0)

    inits = [None, functools.partial(torch.nn.init.uniform_, a=-0.5, b=0.5), ones]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40 + i,
                                 feature_names=[f"f{i}"], init_fn=fn)
              for i, fn in enumerate(inits)]
    module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    report = metamat_materialize(module, device="cpu", seed=SEED)
    bags = module.embedding_bags
    assert torch.equal(bags["t0"].weight, reference_table("t0", 40, 8, SEED))
    assert torch.equal(bags["t1"].weight,
                       reference_table("t1", 41, 8, SEED, metamat.Uniform(-0.5, 0.5)))
    assert torch.equal(bags["t2"].weight, torch.ones(42, 8))
    assert all(s.startswith("rule: TorchRec table") for s in report.sources.values()), \
        report.sources


@pytest.mark.parametrize("name", ["CrossNet", "LowRankCrossNet", "VectorCrossNet",
                                  "LowRankMixtureCrossNet"])
def test_cross_networks_on_meta_get_torchrec_init(name):
    """TorchRec's cross networks (DLRM-DCN) initialise in their constructors, with no reset
    method: each kernel xavier_normal_, each bias zeros_, as fused rules."""
    from torchrec.modules import crossnet

    cls = getattr(crossnet, name)
    kwargs = {"in_features": 128, "num_layers": 2}
    if name == "LowRankCrossNet":
        kwargs["low_rank"] = 64
    if name == "LowRankMixtureCrossNet":
        kwargs.update(num_experts=2, low_rank=64)
    with torch.device("meta"):
        model = cls(**kwargs)
    report = metamat_materialize(model, device="cpu", seed=SEED)
    torch.manual_seed(0)
    eager = cls(**kwargs)
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert not p.is_meta and p.shape == q.shape, n
        if n.startswith("bias."):
            assert torch.equal(p, torch.zeros_like(p)), n
            continue
        if n.startswith("gates."):  # nn.Linear: its own rule
            continue
        assert report.sources[n].startswith("rule: "), report.sources[n]
        # xavier_normal_'s std, from torch's own fan computation; a sample std is within
        # ~4 standard errors (sigma / sqrt(2n)) of it
        fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(q)
        want = (2.0 / (fan_in + fan_out)) ** 0.5
        tol = 4 / (2 * p.numel()) ** 0.5
        assert abs(p.std().item() / want - 1) < tol, (n, p.std().item(), want)
        assert abs(q.std().item() / want - 1) < tol, (n, q.std().item(), want)  # TorchRec's
        assert abs(p.mean().item()) < 4 * want / p.numel() ** 0.5, n
