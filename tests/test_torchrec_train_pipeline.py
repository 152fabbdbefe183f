"""Training as TorchRec users do, after ``materialize``: ``TrainPipelineSparseDist``
(which traces the model and moves each sharded module's input distribution ahead of the
forward) over a DLRM sharded on meta, with the fused table optimizer and a dense optimizer
combined as TorchRec's examples do, gives the losses and the trained state of an eager
TorchRec DMP holding the same values (2 gloo ranks; one GPU in the ``cuda`` test). The
same for a table optimizer chosen with ``_apply_optimizer_in_backward`` on the meta module."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

# every sharding type of the CPU kernels, and a data-parallel table the dense optimizer trains
LAYOUT = {"t0": ("tw", "fused"), "t1": ("rw", "fused"), "t2": ("cw", "fused"),
          "t3": ("dp", "dense")}
STEPS = 4


def _dlrm_train(device, world_size: int, device_type: str):
    from torchrec.models.dlrm import DLRMTrain

    module, sharder, plan, tables = M.build("dlrm", LAYOUT, world_size, device_type=device_type,
                                            device=torch.device(device))
    from torchrec.distributed.types import ShardingPlan

    plan = ShardingPlan({f"model.{k}": v for k, v in plan.plan.items()})
    return DLRMTrain(module), sharder, plan, tables


def _pipeline(model, device):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    return TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer, dense]),
                                   device)


def _batches(rank: int, num_tables: int, device):
    from torchrec.datasets.utils import Batch

    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        yield Batch(dense_features=torch.randn(4, 4, generator=g),
                    sparse_features=M.batch(num_tables, seed=10 * step + rank),
                    labels=torch.randint(0, 2, (4,), generator=g).float()).to(device)


def worker(rank, world_size, device_type="cpu"):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    dev = torch.device("cpu") if device_type == "cpu" else torch.device("cuda", rank)
    module, sharder, plan, tables = _dlrm_train("meta", world_size, device_type)
    gpu = {} if device_type == "cpu" else {"compute_device": "cuda"}
    ours = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], **gpu)
    metamat.materialize(ours, seed=1)
    eager = DistributedModelParallel(_dlrm_train(dev, world_size, device_type)[0],
                                     ShardingEnv.from_process_group(dist.group.WORLD),
                                     device=dev, plan=plan, sharders=[sharder])
    eager.load_state_dict(ours.state_dict())
    res = {"init": M.local_blocks(ours.state_dict())}
    # the values the unsharded model gets on the CPU, bit for bit (tables and dense layers)
    ref = _dlrm_train("meta", world_size, "cpu")[0]
    metamat.materialize(ref, device="cpu", seed=1)
    res["init_bits"] = M.block_mismatches(res["init"], ref.state_dict())
    for name, model in (("ours", ours), ("eager", eager)):
        pipe, batches = _pipeline(model, dev), _batches(rank, len(tables), dev)
        res[name] = [pipe.progress(batches)[0].detach().cpu() for _ in range(STEPS)]
        res[name + "_state"] = dict(M.local_blocks(model.state_dict()),
                                    **M.optimizer_blocks(model))
    return res


def _check(ranks, exact: bool) -> None:
    same = (lambda a, b: torch.equal(M.bits(a), M.bits(b))) if exact else (
        lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6))
    for r in ranks:
        assert r["init_bits"] == [], r["init_bits"]
        assert len(r["ours"]) == STEPS
        for ours, eager in zip(r["ours"], r["eager"]):
            assert same(ours, eager), (ours, eager)
    # tables (fused row-wise Adagrad), the data-parallel table and dense layers (SGD), and
    # the optimizer state: the same values after the steps
    keys = {k for r in ranks for k in r["init"]}
    for r in ranks:
        assert sorted(r["ours_state"]) == sorted(r["eager_state"])
        for k, blocks in r["eager_state"].items():
            assert len(r["ours_state"][k]) == len(blocks), k
            for (o1, a), (o2, b) in zip(r["ours_state"][k], blocks):
                assert o1 == o2 and same(a.cpu(), b.cpu()), k
    trained = {k for r in ranks for k in r["init"] if any(
        not torch.equal(a, b) for (_, a), (_, b) in zip(r["init"][k], r["ours_state"][k]))}
    # every table and dense layer was trained (``t3``: data-parallel, by the dense SGD)
    assert trained == keys, sorted(keys - trained)


@pytest.mark.multiprocess
def test_train_pipeline_on_materialized_dlrm_equals_eager():
    _check(run_dist(worker, 2), exact=True)


@pytest.mark.cuda
def test_train_pipeline_on_gpu_equals_eager():
    """The same on one GPU (one rank): fbgemm's CUDA layout, TorchRec's pipeline with its
    CUDA streams (input copies and input distribution overlapped with the previous step)."""
    _check(run_dist(worker, 1, "cuda", backend="nccl"), exact=False)


def worker_in_backward(rank, world_size, built_on):
    """The table optimizer chosen with torch's ``_apply_optimizer_in_backward`` on the
    unsharded module (TorchRec's examples' way; the sharder fuses it), on meta and eager; the
    module given to ``shard_on_meta`` built on ``built_on`` (its real tables are moved to
    meta, the optimizer choice kept)."""
    import torch.distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim import RowWiseAdagrad

    import metamat

    layout = {"t0": ("tw", "fused"), "t1": ("rw", "fused"), "t2": ("cw", "fused")}
    models = []
    for ours in (True, False):
        module, _, plan, tables = M.build("ebc", layout, world_size, device_type="cpu",
                                          device=torch.device(built_on if ours else "cpu"))
        _apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": 0.05})
        sharder = EmbeddingBagCollectionSharder()
        if ours:
            model = metamat.shard_on_meta(module, plan=plan, sharders=[sharder])
            metamat.materialize(model, seed=2)
        else:
            model = DistributedModelParallel(
                module, ShardingEnv.from_process_group(dist.group.WORLD),
                device=torch.device("cpu"), plan=plan, sharders=[sharder])
            model.load_state_dict(models[0].state_dict())
        models.append(model)
    res = {"init": [M.optimizer_blocks(m) for m in models]}
    for step in range(2):
        b = M.batch(len(layout), seed=10 * step + rank)
        res[f"out{step}"] = [M.backward(m, b).detach() for m in models]
    res["after"] = [dict(M.local_blocks(m.state_dict()), **M.optimizer_blocks(m))
                    for m in models]
    return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("built_on", ["meta", "cpu"])
def test_optimizer_in_backward_on_meta_trains_like_eager(built_on):
    ranks = run_dist(worker_in_backward, 2, built_on)
    # row-wise Adagrad's state: TorchRec's initial value, then the same training
    M.assert_same([r["init"][0] for r in ranks], [r["init"][1] for r in ranks], "init state")
    assert any(k.startswith("state.") for r in ranks for k in r["init"][0])
    for r in ranks:
        for step in range(2):
            ours, eager = r[f"out{step}"]
            assert torch.equal(M.bits(ours), M.bits(eager))
    M.assert_same([r["after"][0] for r in ranks], [r["after"][1] for r in ranks], "trained")
