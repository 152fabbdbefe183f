"""TorchRec's FeatureProcessedEmbeddingBagCollection (position-weighted features) on meta:
shard_on_meta + materialize on 2 gloo ranks gives the tables metamat's plan-invariant values
and the position weights TorchRec's (ones, fused), keeps the module's own alias dict of those
weights pointing at the real ones, and loads a DCP checkpoint of an eager DMP bit for bit (the
forward pass then equals the eager model's)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.rules import default_table_dist  # noqa: E402

from _dist import run_dist  # noqa: E402

KINDS = ["row_wise", "table_wise", "column_wise", "table_wise"]
ROWS, DIM, MAX_LEN = 40, 8, 6


def _fpebc(device, collection: bool = True):
    """4 weighted tables with position weights: one PositionWeightedModuleCollection, or
    (``collection=False``) a dict of PositionWeightedModules, TorchRec's two forms."""
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.feature_processor_ import (PositionWeightedModule,
                                                     PositionWeightedModuleCollection)
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS + 3 * i,
                           feature_names=[f"f{i}"]) for i in range(len(KINDS))],
        is_weighted=True, device=device)
    if collection:
        fp = PositionWeightedModuleCollection(
            max_feature_lengths={f"f{i}": MAX_LEN for i in range(len(KINDS))}, device=device)
    else:
        fp = {f"f{i}": PositionWeightedModule(MAX_LEN, device=device) for i in range(len(KINDS))}
    return FeatureProcessedEmbeddingBagCollection(ebc, fp)


def _sharder():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    return FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}))


def _plan(module, sharder, world_size):
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan

    gen = {"row_wise": row_wise, "column_wise": lambda: column_wise(ranks=[0, 1]),
           "table_wise": lambda: table_wise(rank=1)}
    mp = construct_module_sharding_plan(
        module, {f"t{i}": gen[k]() for i, k in enumerate(KINDS)}, local_size=world_size,
        world_size=world_size, device_type="cpu", sharder=sharder)
    for ps in mp.values():
        ps.compute_kernel = "fused"
    return ShardingPlan({"": mp})


def _batch(rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 + rank)
    n = len(KINDS)
    lengths = torch.randint(0, MAX_LEN + 1, (n * 3,), generator=g)
    values = torch.cat([torch.randint(0, ROWS, (int(l),), generator=g) for l in lengths])
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(n)], values=values,
                                               lengths=lengths)


def _blocks(model):
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "local_shards"):
            out[k] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone())
                      for s in v.local_shards()]
        else:
            out[k] = [((0,), v.detach().clone())]
    return out


def worker(rank, world_size, tmp):
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    sharder = _sharder()
    plan = _plan(_fpebc(torch.device("meta")), sharder, world_size)

    # initial values: plan-invariant tables, ones for the position weights
    model = metamat.shard_on_meta(_fpebc(torch.device("meta")), env=env, plan=plan,
                                  sharders=[sharder])
    metamat.materialize(model, device="cpu", seed=5)
    fp = model.module._feature_processors
    aliases_ok = all(fp.position_weights_dict[k] is p for k, p in fp.position_weights.items())
    meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if t.is_meta] + (["_no_op_zero"] if model.module._no_op_zero.is_meta else [])
    init_blocks = _blocks(model)
    out_init = model(_batch(rank)).values().detach().clone()

    # an eager DMP (TorchRec's own random init) saved with DCP, loaded into a meta one
    torch.manual_seed(rank)
    eager = DistributedModelParallel(_fpebc(torch.device("meta")), env=env,
                                     device=torch.device("cpu"), plan=plan, sharders=[sharder])
    g = torch.Generator().manual_seed(7)  # replicated: the same on every rank, as DDP keeps it
    with torch.no_grad():
        for p in eager.module._feature_processors.position_weights.values():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # not ones: the load must bring them
    path = os.path.join(tmp, "ckpt")
    dcp.save(eager.state_dict(), checkpoint_id=path)
    loaded = metamat.shard_on_meta(_fpebc(torch.device("meta")), env=env, plan=plan,
                                   sharders=[sharder])
    metamat.materialize(loaded, path, device="cpu")
    batch = _batch(rank)

    # the other form: a dict of PositionWeightedModules (a ModuleDict once sharded)
    per_feature = metamat.shard_on_meta(_fpebc(torch.device("meta"), collection=False), env=env,
                                        plan=plan, sharders=[sharder])
    metamat.materialize(per_feature, device="cpu", seed=5)
    pw = {k: m.position_weight.detach().clone()
          for k, m in per_feature.module._feature_processors.items()}
    per_feature_out = per_feature(_batch(rank)).values().detach()
    return dict(init_blocks=init_blocks, meta_left=meta_left, aliases_ok=aliases_ok,
                per_feature_pw=pw, per_feature_finite=bool(torch.isfinite(per_feature_out).all()),
                out_init_finite=bool(torch.isfinite(out_init).all()),
                eager=_blocks(eager), loaded=_blocks(loaded),
                out_eager=eager(batch).values().detach(),
                out_loaded=loaded(batch).values().detach(),
                loaded_aliases_ok=all(
                    loaded.module._feature_processors.position_weights_dict[k] is p
                    for k, p in loaded.module._feature_processors.position_weights.items()))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_dist(worker, 2, str(tmp_path_factory.mktemp("fpebc")))


def test_initial_values_plan_invariant_and_position_weights_one(ranks):
    for r in ranks:
        assert r["meta_left"] == [] and r["aliases_ok"] and r["out_init_finite"]
    seen = set()
    for r in ranks:
        for key, blocks in r["init_blocks"].items():
            for off, t in blocks:
                if "position_weights" in key:
                    assert torch.equal(t, torch.ones(MAX_LEN)), key
                    continue
                name = key.split(".")[-2]
                rows = ROWS + 3 * int(name[1:])
                full = torch.empty(rows, DIM)
                metamat.fill_(full, default_table_dist(rows), seed=5, key=name)
                idx = tuple(slice(o, o + s) for o, s in zip(off, t.shape))
                assert torch.equal(t, full[idx]), (key, off)
                seen.add(key)
    assert len(seen) == len(KINDS)  # every table has a block somewhere
    for r in ranks:  # the dict-of-modules form: the same rule, module by module
        assert r["per_feature_finite"] and len(r["per_feature_pw"]) == len(KINDS)
        for k, w in r["per_feature_pw"].items():
            assert torch.equal(w, torch.ones(MAX_LEN)), k


def test_dcp_checkpoint_of_eager_dmp_loads_bit_for_bit(ranks):
    for r in ranks:
        assert r["loaded_aliases_ok"]
        assert r["eager"].keys() == r["loaded"].keys()
        for key, blocks in r["eager"].items():
            got = dict(r["loaded"][key])
            for off, t in blocks:
                assert torch.equal(got[off].view(torch.int32), t.view(torch.int32)), (key, off)
        assert torch.equal(r["out_loaded"], r["out_eager"])


def test_position_weights_alone_are_ones_by_the_fused_rule(monkeypatch):
    from torchrec.modules.feature_processor_ import (PositionWeightedModule,
                                                     PositionWeightedModuleCollection)

    def twos(self):  # were the module's own reset called, the weights would be 2
        with torch.no_grad():
            self.position_weight.fill_(2.0)

    monkeypatch.setattr(PositionWeightedModule, "reset_parameters", twos)
    col = PositionWeightedModuleCollection(max_feature_lengths={"a": 3, "b": 5},
                                           device=torch.device("meta"))
    one = PositionWeightedModule(max_feature_length=4, device=torch.device("meta"))
    metamat.materialize(col, device="cpu")
    metamat.materialize(one, device="cpu")
    assert torch.equal(col.position_weights["a"], torch.ones(3))
    assert torch.equal(col.position_weights["b"], torch.ones(5))
    assert torch.equal(one.position_weight, torch.ones(4))
    # the module's own dict of its weights (what forward reads) holds the new ones
    assert all(col.position_weights_dict[k] is p for k, p in col.position_weights.items())


def test_a_container_rule_covers_only_the_container_it_names():
    from torch import nn

    class WithExtra(nn.Linear):  # Linear's rule is for weight and bias, not this dict
        def __init__(self):
            super().__init__(16, 4, device="meta")
            self.lora = nn.ParameterDict({"B": nn.Parameter(torch.zeros(4, 2, device="meta"))})

    m = WithExtra()
    with pytest.raises(metamat.MissingValueError, match="'lora.B'"):
        metamat.materialize(m, device="cpu")
    assert m.weight.is_meta and m.lora["B"].is_meta
