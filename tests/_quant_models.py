"""Quantized TorchRec models for the tests (and the quant bench): the float model they come
from, TorchRec's own conversion of it (the reference), the same quantized model built on meta,
sharded with TorchRec's quant sharders (TW/RW/CW), and comparisons."""
from __future__ import annotations

import contextlib
import copy
from typing import Dict, List, Optional

import torch
from torch import nn

from _torchrec_gpu_models import memory_kind

#: torch dtypes TorchRec's quantization takes, by the TBE type they give
QDTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4,
           "fp16": torch.float16, "fp32": torch.float32}


def ebc_tables(dims=(8, 16, 40), rows=(37, 1, 100), fp16: bool = False):
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType

    dt = DataType.FP16 if fp16 else DataType.FP32
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r,
                               feature_names=[f"f{i}"], data_type=dt)
            for i, (d, r) in enumerate(zip(dims, rows))]


def ec_tables(dim=16, rows=(37, 1, 100)):
    from torchrec import EmbeddingConfig

    return [EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=r,
                            feature_names=[f"f{i}"]) for i, r in enumerate(rows)]


class Model(nn.Module):
    """A collection (EBC or EC) under ``coll`` and a dense layer: the dense part stays float."""

    def __init__(self, tables, device, ec: bool = False) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection

        self.coll = (EmbeddingCollection if ec else EmbeddingBagCollection)(
            tables=tables, device=device)
        self.dense = nn.Linear(4, 2, device=device)

    def forward(self, kjt):
        return self.coll(kjt)


def float_model(tables, seed: int = 0, ec: bool = False) -> Model:
    """A trained-looking float model on the CPU (random tables, not TorchRec's init)."""
    torch.manual_seed(seed)
    m = Model(tables, torch.device("cpu"), ec=ec)
    with torch.no_grad():
        for k, v in m.state_dict().items():
            v.copy_(torch.randn(v.shape, dtype=torch.float32).to(v.dtype))
    return m


def quantize(model: nn.Module, qdtype: str, split: bool) -> nn.Module:
    """TorchRec's conversion (``quantize_dynamic`` with its quant module mapping, as
    ``quantize_embeddings`` does), of a copy."""
    from torchrec.distributed.test_utils.infer_utils import quantize as trec_quantize

    return trec_quantize(copy.deepcopy(model), inplace=False, weight_dtype=QDTYPES[qdtype],
                         quant_state_dict_split_scale_bias=split)


def meta_quant(tables, qdtype: str, split: bool, ec: bool = False) -> nn.Module:
    """The same quantized model, built on meta (nothing allocated)."""
    return quantize(Model(tables, torch.device("meta"), ec=ec), qdtype, split)


@contextlib.contextmanager
def propagate_device():
    """TorchRec's CPU inference sharding needs the device propagated (a global setting)."""
    from torchrec.distributed import global_settings as gs

    old = gs.get_propogate_device()
    gs.set_propogate_device(True)
    try:
        yield
    finally:
        gs.set_propogate_device(old)


def sharder_for(kind: str, tables, ec: bool = False, kernel: str = "quant"):
    from torchrec.distributed.test_utils.infer_utils import (TestQuantEBCSharder,
                                                              TestQuantECSharder)

    st = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise"}[kind]
    if ec:
        return TestQuantECSharder(sharding_type=st, kernel_type=kernel)
    return TestQuantEBCSharder(sharding_type=st, kernel_type=kernel,
                               shardable_params=[t.name for t in tables])


def quant_plan(qmodel: nn.Module, sharder, world_size: int, min_partition: int = 8,
               compute_device: str = "cpu"):
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    names = [n for n, _ in qmodel.coll.embedding_bags.items()] if hasattr(
        qmodel.coll, "embedding_bags") else [n for n, _ in qmodel.coll.embeddings.items()]
    return EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=compute_device), batch_size=1,
        constraints={n: ParameterConstraints(min_partition=min_partition) for n in names},
    ).plan(qmodel, [sharder])


def shard(qmodel: nn.Module, sharder, plan, world_size: int, device: str,
          compute_device: str = "cpu") -> nn.Module:
    """``shard_quant_model`` of a copy: ``device="cpu"`` (or ``"cuda"``) is TorchRec's real
    sharding (its tables zeros until loaded), ``"meta"`` the one metamat materializes."""
    from torchrec.inference.modules import shard_quant_model

    with propagate_device() if device == "cpu" else contextlib.nullcontext():
        out, _ = shard_quant_model(copy.deepcopy(qmodel), world_size=world_size,
                                   compute_device=compute_device, sharding_device=device,
                                   sharders=[sharder], sharding_plan=plan)
    return out


def batch(names: List[str], rows: List[int], batch_size: int = 6, seed: int = 0):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(names) * batch_size,), generator=g)
    vals = []
    for f, r in enumerate(rows):
        n = int(lengths[f * batch_size:(f + 1) * batch_size].sum())
        vals.append(torch.randint(0, r, (n,), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.cat(vals),
                                               lengths=lengths)


def forward(model: nn.Module, kjt) -> torch.Tensor:
    with propagate_device():
        out = model(kjt)
    if isinstance(out, dict):  # EmbeddingCollection: feature -> JaggedTensor
        return torch.cat([out[k].values().reshape(-1) for k in sorted(out)])
    return out.values()


def raw(t) -> torch.Tensor:
    """The bytes of a state_dict tensor (TorchRec's UInt4/UInt2 wrappers: their uint8)."""
    return t.elem if hasattr(t, "elem") else t


def state_bytes(model: nn.Module) -> Dict[str, list]:
    """state_dict -> {key: [(offsets, tensor)]} for tensors, sharded tensors and CW lists."""
    out: Dict[str, list] = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "local_shards"):
            out[k] = [(tuple(s.metadata.shard_offsets), raw(s.tensor)) for s in v.local_shards()]
        elif isinstance(v, list):
            out[k] = [((i,), raw(x)) for i, x in enumerate(v)]
        elif isinstance(v, torch.Tensor):
            out[k] = [((), raw(v))]
    return out


def tbes(model: nn.Module) -> list:
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen)
    from metamat.models.torchrec.graph import scan

    return [o for o in scan(model).objects.values()
            if isinstance(o, IntNBitTableBatchedEmbeddingBagsCodegen)]


TBE_ATTRS = ("current_device", "use_cpu", "embedding_specs", "row_alignment", "host_size",
             "dev_size", "uvm_size", "weights_physical_placements", "weights_physical_offsets",
             "weight_initialized", "feature_table_map", "pooling_mode")


def assert_same_quant_state(want: nn.Module, got: nn.Module, what: str = "",
                            prefix: str = "") -> None:
    """Every table byte, scale and bias equal (state_dict keys starting with ``prefix``);
    every inference TBE laid out alike (buffers, weights, attributes)."""
    a, b = state_bytes(want), state_bytes(got)
    keys = [k for k in a if ".tbes." not in k and k.startswith(prefix)]
    assert keys and all(k in b for k in keys), (what, sorted(set(a) ^ set(b)))
    for k in keys:
        assert [o for o, _ in a[k]] == [o for o, _ in b[k]], (what, k)
        for (_, x), (_, y) in zip(a[k], b[k]):
            assert x.device == y.device and x.dtype == y.dtype and x.shape == y.shape, (what, k)
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 else x,
                               y.view(torch.uint8) if y.dtype != torch.uint8 else y), (what, k)
    ta, tb = tbes(want), tbes(got)
    assert len(ta) == len(tb) > 0, what
    for x, y in zip(ta, tb):
        for name in TBE_ATTRS:
            assert getattr(x, name) == getattr(y, name), (what, name)
        for name in ("weights_host", "weights_dev", "weights_uvm", "weights_offsets",
                     "weights_placements"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.device == v.device and torch.equal(u, v), (what, name)
        u, v = x.weights_uvm, y.weights_uvm
        if u.is_cuda and u.numel():  # the same kind of memory, as CUDA reports it
            assert memory_kind(u) == memory_kind(v), (what, memory_kind(u), memory_kind(v))
        bx, by = dict(x.named_buffers()), dict(y.named_buffers())
        assert bx.keys() == by.keys(), what
        for n in bx:
            assert bx[n].device == by[n].device and torch.equal(bx[n], by[n]), (what, n)


def no_meta(model: nn.Module) -> bool:
    from metamat.models.torchrec.graph import scan

    g = scan(model)
    return not g.meta_tensors()


def table_names(model: nn.Module) -> List[str]:
    coll = model.coll
    tables = coll.embedding_bag_configs() if hasattr(coll, "embedding_bag_configs") \
        else coll.embedding_configs()
    return [t.name for t in tables]


def feature_rows(tables) -> Optional[tuple]:
    return [f"f{i}" for i in range(len(tables))], [t.num_embeddings for t in tables]
