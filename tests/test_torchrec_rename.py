"""``materialize(model, ckpt, rename=...)`` on TorchRec models: a table's fused-optimizer
state follows its weight's rename. A checkpoint saved by an eager DMP whose collection and
tables had other names loads, on 2 gloo ranks and another plan, tables and row-wise Adagrad
state bit for bit, nothing initialised."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.models.torchrec.optim_keys import renamed_state, renamed_weights  # noqa: E402

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

ROWS = (16, 37, 9)
DIM = 8


class Holder(nn.Module):
    """An EmbeddingBagCollection under ``name``, its tables named ``<table_prefix><i>``."""

    def __init__(self, name: str, table_prefix: str, device) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        setattr(self, name, EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"{table_prefix}{i}", embedding_dim=DIM, num_embeddings=r,
                               feature_names=[f"f{i}"]) for i, r in enumerate(ROWS)],
            device=device))
        self.name = name

    def forward(self, kjt):
        return getattr(self, self.name)(kjt)


def _plan(model: Holder, table_prefix: str, kind: str, world_size: int, sharder):
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingPlan

    spec = {"rw": lambda i: row_wise(), "tw": lambda i: table_wise(rank=i % world_size)}[kind]
    mp = construct_module_sharding_plan(
        getattr(model, model.name), {f"{table_prefix}{i}": spec(i) for i in range(len(ROWS))},
        local_size=world_size, world_size=world_size, device_type="cpu", sharder=sharder)
    for ps in mp.values():  # fused tables: their optimizer state is the module's
        ps.compute_kernel = "fused"
    return ShardingPlan({model.name: mp})


def _renamed(key: str) -> str:
    """The loaded model's key -> the saved one's (``emb.embedding_bags.u1.weight`` ->
    ``model.sparse.embedding_bags.t1.weight``)."""
    head, _, rest = key.partition(".")
    if head != "emb":
        return "model." + key
    return "model.sparse." + rest.replace(".u", ".t", 1)


def worker_rename(rank, world_size, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    sharder = EmbeddingBagCollectionSharder(fused_params=M.fused_params())
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    eager = DistributedModelParallel(
        Holder("sparse", "t", torch.device("cpu")), env, device=torch.device("cpu"),
        plan=_plan(Holder("sparse", "t", "meta"), "t", "rw", world_size, sharder),
        sharders=[sharder])
    M.backward(eager, M.batch(len(ROWS), seed=rank, rows=min(ROWS)))  # Adagrad state != 0
    path = os.path.join(tmp, "ckpt")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=path)

    def saved_names(blocks):
        return {k.replace("sparse.", "emb.").replace(".t", ".u"): v for k, v in blocks.items()}

    saved = saved_names(dict(M.local_blocks(eager.state_dict()), **M.optimizer_blocks(eager)))
    out = {"saved": saved}
    mapping = {f"emb.embedding_bags.u{i}.weight": f"model.sparse.embedding_bags.t{i}.weight"
               for i in range(len(ROWS))}
    for how, rename in (("callable", _renamed), ("mapping", mapping)):
        model = metamat.shard_on_meta(
            Holder("emb", "u", "meta"),
            plan=_plan(Holder("emb", "u", "meta"), "u", "tw", world_size, sharder),
            sharders=[sharder])
        report = metamat.materialize(model, path, rename=rename)
        out[how] = (dict(M.local_blocks(model.state_dict()), **M.optimizer_blocks(model)),
                    report.initialized, report.unexpected)
    return out


@pytest.mark.multiprocess
def test_optimizer_state_follows_rename(tmp_path):
    """The collection ``sparse`` with tables ``t*`` saved row-wise; loaded as ``emb`` with
    tables ``u*``, table-wise, through ``rename`` (a callable, a mapping): the row-wise
    Adagrad state comes from ``optim.state.sparse.embedding_bags.t<i>.weight.t<i>.momentum1``,
    bit for bit."""
    ranks = run_dist(worker_rename, 2, str(tmp_path))
    saved = [r["saved"] for r in ranks]
    assert any(k.startswith("state.emb.embedding_bags.u") for r in saved for k in r)
    for how in ("callable", "mapping"):
        M.assert_same(saved, [r[how][0] for r in ranks], how)
        assert all(r[how][1] == [] and r[how][2] == [] for r in ranks), how


def test_renamed_state_names():
    """The saved names of a renamed table's state: the renamed weight without its model
    prefix (longest first), the table's name taken from it; nothing for a weight the rename
    leaves alone or a name that is no table's state."""
    weights = {"emb.embedding_bags.u0.weight"}
    fn = {"emb.embedding_bags.u0.weight": "model.sparse.embedding_bags.t0.weight"}.get
    assert renamed_weights("emb.embedding_bags.u0.weight", fn) == [
        "sparse.embedding_bags.t0.weight", "model.sparse.embedding_bags.t0.weight"]
    assert renamed_state("state.emb.embedding_bags.u0.weight.u0.momentum1", weights, fn) == [
        "state.sparse.embedding_bags.t0.weight.t0.momentum1",
        "state.model.sparse.embedding_bags.t0.weight.t0.momentum1"]
    same = (lambda k: k)
    assert renamed_state("state.emb.embedding_bags.u0.weight.u0.momentum1", weights, same) == []
    assert renamed_state("state.other.weight.x.momentum1", weights, fn) == []
    # a rename into a key that is not a TorchRec weight: the table part is kept
    odd = (lambda k: "module.tables.first")
    assert renamed_state("state.emb.embedding_bags.u0.weight.u0.momentum1", weights, odd) == [
        "state.tables.first.u0.momentum1", "state.module.tables.first.u0.momentum1"]
