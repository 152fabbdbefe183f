"""TorchRec module types beyond the embedding collections: ``shard_on_meta`` refuses the ones
it cannot build by name, before anything is built (TorchRec's own failures on meta name
neither the module nor the cause), and builds FusedEmbeddingBagCollection's sharded tables,
which then train like an eager TorchRec DMP."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.models.torchrec.module_kinds import REFUSED  # noqa: E402

import _torchrec_gpu_models as M  # noqa: E402

ROWS, DIM = (16, 23), 8


def _bag_configs():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=r,
                               feature_names=[f"f{i}"]) for i, r in enumerate(ROWS)]


def _ebc(device="meta"):
    from torchrec import EmbeddingBagCollection

    return EmbeddingBagCollection(tables=_bag_configs(), device=torch.device(device))


def _types(module: nn.Module) -> list:
    return [(n, type(m)) for n, m in module.named_modules()]


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_refused_type_exists_in_this_torchrec(key):
    """The table names TorchRec's real classes (a renamed class would be let through)."""
    module, name = key
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not in this TorchRec")
    assert isinstance(getattr(importlib.import_module(module), name), type)


def _towers():
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    return nn.ModuleDict({"sparse": EmbeddingTowerCollection(
        [EmbeddingTower(_ebc(), nn.Linear(DIM, 1, device="meta"))])})


def _itep():
    from torchrec.modules.itep_embedding_modules import ITEPEmbeddingBagCollection
    from torchrec.modules.itep_modules import GenericITEPModule

    return nn.ModuleDict({"pruned": ITEPEmbeddingBagCollection(
        _ebc(), GenericITEPModule({f"t{i}": r for i, r in enumerate(ROWS)}))})


def test_embedding_tower_with_its_sharder_refused_by_name(world1_env):
    from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerCollectionSharder

    model = _towers()
    before = _types(model)
    with pytest.raises(metamat.UnsupportedError,
                       match=r"^sparse: TorchRec's EmbeddingTowerCollection cannot be sharded on "
                             r"meta \(its sharded form wraps the interaction module in "
                             r"DistributedDataParallel"):
        metamat.shard_on_meta(model, env=world1_env,
                              sharders=[EmbeddingTowerCollectionSharder()])
    assert _types(model) == before  # nothing was sharded


def test_itep_with_its_sharder_refused_by_name(world1_env):
    pytest.importorskip("torchrec.distributed.itep_embeddingbag")
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.itep_embeddingbag import ITEPEmbeddingBagCollectionSharder

    model = _itep()
    before = _types(model)
    with pytest.raises(metamat.UnsupportedError, match=r"^pruned: TorchRec's "
                       r"ITEPEmbeddingBagCollection cannot be sharded on meta"):
        metamat.shard_on_meta(model, env=world1_env, sharders=[
            ITEPEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder())])
    assert _types(model) == before


@pytest.mark.parametrize("build", ["towers", "itep"])
def test_without_their_sharder_the_collections_inside_are_sharded(world1_env, build):
    """TorchRec's default sharders have none for towers or ITEP modules: it shards the
    EmbeddingBagCollection inside them, which materializes as any other."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    if build == "itep":
        pytest.importorskip("torchrec.modules.itep_embedding_modules")
    model = metamat.shard_on_meta(_towers() if build == "towers" else _itep(),
                                  env=world1_env, compute_device="cpu")
    metamat.materialize(model, seed=1)
    kinds = [type(m) for m in model.modules()]
    assert ShardedEmbeddingBagCollection in kinds
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _fused_ebc(device):
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    return FusedEmbeddingBagCollection(tables=_bag_configs(), optimizer_type=torch.optim.SGD,
                                       optimizer_kwargs={"lr": 0.1},
                                       device=torch.device(device))


def _fused_plan(shardings):
    from torchrec.distributed.fused_embeddingbag import FusedEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    sharder = FusedEmbeddingBagCollectionSharder()
    mp = construct_module_sharding_plan(_fused_ebc("meta"), shardings, local_size=1,
                                        world_size=1, device_type="cpu", sharder=sharder)
    for ps in mp.values():  # the module's optimizer fused into the backward
        if ps.sharding_type != "data_parallel":
            ps.compute_kernel = "fused"
    return sharder, ShardingPlan({"": mp})


@pytest.mark.parametrize("path", ["", "a.b"])
def test_fused_ebc_data_parallel_table_refused_by_name(world1_env, path):
    from torchrec.distributed.sharding_plan import data_parallel, table_wise
    from torchrec.distributed.types import ShardingPlan

    sharder, plan = _fused_plan({"t0": table_wise(rank=0), "t1": data_parallel()})
    model = _fused_ebc("meta")
    if path:  # the collection deeper in the model, its plan under that path
        model = nn.ModuleDict({"a": nn.ModuleDict({"b": model})})
        plan = ShardingPlan({path: plan.plan[""]})
    before = _types(model)
    with pytest.raises(metamat.UnsupportedError, match=rf"^{path or '<root>'}: "
                       r"FusedEmbeddingBagCollection table 't1' is planned data-parallel"):
        metamat.shard_on_meta(model, env=world1_env, plan=plan, sharders=[sharder])
    assert _types(model) == before


def test_fused_ebc_sharded_tables_init_and_train_like_eager(world1_env):
    """Table- and row-wise: the tables get an EmbeddingBagCollection's values (the same
    names, the same seed); an eager TorchRec DMP holding them trains to the same bits."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    sharder, plan = _fused_plan({"t0": table_wise(rank=0), "t1": row_wise()})
    model = metamat.shard_on_meta(_fused_ebc("meta"), env=world1_env, plan=plan,
                                  sharders=[sharder])
    metamat.materialize(model, seed=4)
    ebc = _ebc()
    metamat.materialize(ebc, device="cpu", seed=4)
    ours = M.local_blocks(model.state_dict())
    for k, v in ebc.state_dict().items():
        (offsets, block), = ours[k]
        assert offsets == (0, 0) and torch.equal(M.bits(block), M.bits(v)), k
    eager = DistributedModelParallel(_fused_ebc("cpu"), world1_env, device=torch.device("cpu"),
                                     plan=plan, sharders=[sharder])
    eager.load_state_dict(model.state_dict())
    for step in range(2):
        b = M.batch(len(ROWS), seed=step, rows=min(ROWS))
        assert torch.equal(M.bits(M.backward(model, b).detach()),
                           M.bits(M.backward(eager, b).detach()))
    after, want = M.local_blocks(model.state_dict()), M.local_blocks(eager.state_dict())
    for k in want:
        assert torch.equal(M.bits(after[k][0][1]), M.bits(want[k][0][1])), k
    init = ebc.state_dict()  # the steps did update the tables (SGD fused into backward)
    assert [k for k in want if torch.equal(after[k][0][1], init[k])] == []
