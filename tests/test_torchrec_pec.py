"""TorchRec's PECEmbeddingCollection (prioritized embedding communication, row-wise only; a
default sharder from torchrec 1.9) on meta: shard_on_meta + materialize on 2 gloo ranks gives
the tables the values of a plain EmbeddingCollection with the same tables (plan-invariant
values), real overlap-handler state, training steps equal to an eager TorchRec DMP holding
the same values, and a DCP checkpoint of that eager model loaded bit for bit (tables and
fused-optimizer state)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")
pytest.importorskip("torchrec.modules.pec_embedding_modules")  # torchrec >= 1.8

import metamat  # noqa: E402

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

ROWS = (16, 37, 9)  # 37 and 9 rows: uneven row-wise blocks over 2 ranks
DIM = 8
SEED = 3
PREFIX = "_embedding_collection."


def _ec(device):
    from torchrec import EmbeddingCollection, EmbeddingConfig

    return EmbeddingCollection(tables=[
        EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=r,
                        feature_names=[f"f{i}"]) for i, r in enumerate(ROWS)], device=device)


def _pec(device):
    from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

    return PECEmbeddingCollection(_ec(device))


def _sharders():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder

    ec = EmbeddingCollectionSharder(fused_params=M.fused_params())
    return PECEmbeddingCollectionSharder(ec), ec


def _plan(module, sharder, world_size):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    mp = construct_module_sharding_plan(
        module, {f"t{i}": row_wise() for i in range(len(ROWS))}, local_size=world_size,
        world_size=world_size, device_type="cpu", sharder=sharder)
    for ps in mp.values():  # fused tables (TorchRec's own PEC forward fails on dense ones)
        ps.compute_kernel = "fused"
    return ShardingPlan({"": mp})


def _batch(step: int, rank: int):
    # consecutive batches share ids: PEC sends the overlapping ones first
    return M.batch(len(ROWS), seed=100 * step + rank, rows=min(ROWS))


def _handlers_state(dmp) -> list:
    out = []
    for h in dmp.module._overlap_handlers:
        mask = h._checker._seen_buffer
        out.append((str(h._device), str(mask.device), mask.dtype, int(mask.numel()),
                    bool(mask.any())))
    return out


def worker_pec(rank, world_size, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    pec_sharder, ec_sharder = _sharders()
    plan = _plan(_pec("meta"), pec_sharder, world_size)
    model = metamat.shard_on_meta(_pec("meta"), plan=plan, sharders=[pec_sharder])
    metamat.materialize(model, seed=SEED)
    res = dict(handlers=_handlers_state(model),
               pec=M.local_blocks({k[len(PREFIX):]: v for k, v in model.state_dict().items()}))
    ec_plan = _plan(_ec("meta"), ec_sharder, world_size)
    ec = metamat.shard_on_meta(_ec("meta"), plan=ec_plan, sharders=[ec_sharder])
    metamat.materialize(ec, seed=SEED)
    res["ec"] = M.local_blocks(ec.state_dict())

    # eager TorchRec holding the same values; both train 3 steps on the same batches
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    eager = DistributedModelParallel(_pec(torch.device("cpu")), env, device=torch.device("cpu"),
                                     plan=plan, sharders=[pec_sharder])
    eager.load_state_dict(model.state_dict())
    outs = []
    for step in range(3):
        b = _batch(step, rank)
        outs.append((M.backward(model, b).detach(), M.backward(eager, b).detach()))
    res["outs"] = outs
    res["trained"] = dict(M.local_blocks(model.state_dict()), **M.optimizer_blocks(model))
    res["eager"] = dict(M.local_blocks(eager.state_dict()), **M.optimizer_blocks(eager))

    # the eager model's checkpoint (tables and row-wise Adagrad state) into a fresh meta PEC
    path = os.path.join(tmp, "ckpt")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=path)
    back = metamat.shard_on_meta(_pec("meta"), plan=plan, sharders=[pec_sharder])
    report = metamat.materialize(back, path)
    res["initialized"] = report.initialized
    res["loaded"] = dict(M.local_blocks(back.state_dict()), **M.optimizer_blocks(back))
    b = _batch(3, rank)
    res["next"] = (M.forward(back, b).detach(), M.forward(eager, b).detach())
    return res


@pytest.mark.multiprocess
def test_pec_init_training_and_dcp_load_world2(tmp_path):
    ranks = run_dist(worker_pec, 2, str(tmp_path))
    # the values of the same tables in a plain EmbeddingCollection, every row written
    M.assert_same([r["pec"] for r in ranks], [r["ec"] for r in ranks], "PEC init vs EC")
    for r in ranks:  # one row-wise handler: its scratch mask real, zeroed, one bit a local row
        local_rows = sum(t.shape[0] for blocks in r["pec"].values() for _, t in blocks)
        assert r["handlers"] == [("cpu", "cpu", torch.bool, local_rows, False)]
        for ours, theirs in r["outs"]:  # forward outputs: eager TorchRec's bits
            assert ours.numel() > 0 and torch.equal(M.bits(ours), M.bits(theirs))
    # after 3 fused row-wise Adagrad steps: the same tables and optimizer state
    M.assert_same([r["trained"] for r in ranks], [r["eager"] for r in ranks], "trained")
    assert any(k.startswith("state.") for k in ranks[0]["trained"])
    # the eager model's DCP checkpoint: loaded bit for bit, nothing initialised
    M.assert_same([r["loaded"] for r in ranks], [r["eager"] for r in ranks], "DCP load")
    assert all(r["initialized"] == [] for r in ranks)
    for r in ranks:
        ours, theirs = r["next"]
        assert torch.equal(M.bits(ours), M.bits(theirs))


def test_unsharded_pec_equals_ec():
    """A PECEmbeddingCollection that is not sharded is an ordinary module: its tables get
    the EmbeddingCollection's values."""
    pec, ec = _pec("meta"), _ec("meta")
    metamat.materialize(pec, device="cpu", seed=SEED)
    metamat.materialize(ec, device="cpu", seed=SEED)
    ours = pec.state_dict()
    for k, v in ec.state_dict().items():
        assert torch.equal(M.bits(ours[PREFIX + k]), M.bits(v)), k


def worker_toggle(rank, world_size, tmp):
    """Checkpoints of the same tables with PEC on and off load into the other model."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    pec_sharder, ec_sharder = _sharders()
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    res = {}
    for saved, wanted in (("ec", "pec"), ("pec", "ec")):
        build = {"ec": (_ec, ec_sharder), "pec": (_pec, pec_sharder)}
        make, sharder = build[saved]
        eager = DistributedModelParallel(make(torch.device("cpu")), env,
                                         device=torch.device("cpu"),
                                         plan=_plan(make("meta"), sharder, world_size),
                                         sharders=[sharder])
        M.backward(eager, _batch(0, rank))  # row-wise Adagrad state != 0
        path = os.path.join(tmp, saved)
        dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
                 checkpoint_id=path)
        make, sharder = build[wanted]
        model = metamat.shard_on_meta(make("meta"), plan=_plan(make("meta"), sharder,
                                                                world_size),
                                      sharders=[sharder])
        report = metamat.materialize(model, path)

        def plain(blocks):  # the EmbeddingCollection's own names
            return {k.replace(PREFIX, ""): v for k, v in blocks.items()}

        res[f"{saved}->{wanted}"] = (
            plain(dict(M.local_blocks(eager.state_dict()), **M.optimizer_blocks(eager))),
            plain(dict(M.local_blocks(model.state_dict()), **M.optimizer_blocks(model))),
            report.initialized)
    return res


@pytest.mark.multiprocess
def test_checkpoints_load_with_pec_toggled(tmp_path):
    """PEC only wraps the collection (its state under ``_embedding_collection.``): a
    checkpoint saved without it loads into a model with it and back, tables and fused
    optimizer state bit for bit, nothing initialised."""
    ranks = run_dist(worker_toggle, 2, str(tmp_path))
    for case in ("ec->pec", "pec->ec"):
        saved = [r[case][0] for r in ranks]
        loaded = [r[case][1] for r in ranks]
        M.assert_same(saved, loaded, case)
        assert any(k.startswith("state.") for r in saved for k in r), case
        assert all(r[case][2] == [] for r in ranks), case
