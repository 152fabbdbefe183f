"""``materialize(..., device="cuda")`` end to end, for every model kind that runs without
TorchRec: a plain module (fused init; loads from safetensors and DCP; a dtype change; an
already-real CUDA model loaded in place), tensor parallel and FSDP2 (DTensor on a ``cuda``
mesh, two gloo ranks sharing the one GPU). Every result is compared bit for bit with the same
call on the CPU, which the rest of the suite checks against the checkpoint and the reference
init. The CPU half of each comparison also runs where there is no GPU (``device`` "cpu"
twice), so the model kinds and checkpoints here are exercised in CI too.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

import metamat
from _dist import run_dist
from metamat.reference import reference_block
from test_load import same_bits

DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda), "cpu"]


class Net(nn.Module):
    """Every fused rule kind; rows the kernel stages whole (D = 96, 64: interior 32-column
    units) and rows it stores itself (D = 24, 40, 7, 3: edge units); odd sizes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1001, 96)
        self.lin = nn.Linear(96, 40)
        self.wide = nn.Linear(64, 300)
        self.norm = nn.LayerNorm(40)
        self.conv = nn.Conv1d(4, 6, 3)
        self.narrow = nn.Linear(7, 3, bias=False)


def _meta(dtype=torch.float32) -> nn.Module:
    with torch.device("meta"):
        return Net().to(dtype)


def _host(m: nn.Module) -> dict:
    return {k: v.detach().to("cpu") for k, v in m.state_dict().items()}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    bad = [k for k in got if not same_bits(got[k], want[k])]
    assert not bad, f"differ: {bad}"


def _on(m: nn.Module, device: str) -> bool:
    return all(t.device.type == device for t in m.state_dict().values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda_ckpt")
    torch.manual_seed(3)
    sd = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    save_file(sd, str(d / "m.safetensors"))
    dcp.save(sd, checkpoint_id=str(d / "dcp"))
    return sd, {"safetensors": str(d / "m.safetensors"), "dcp": str(d / "dcp")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_init_equals_the_cpu_bit_for_bit(device, dtype):
    m = _meta(dtype)
    rep = metamat.materialize(m, device=device, seed=7)
    assert _on(m, device) and rep.bytes_written > 0
    got = _host(m)
    # the NumPy reference of the engine for the tables and a wide Linear (rules.py's dists)
    for key, dist in (("emb.weight", metamat.Normal(0.0, 1.0)),
                      ("wide.weight", metamat.Uniform(-1 / 8, 1 / 8))):
        want = reference_block(tuple(got[key].shape), dist, seed=7, key=key, dtype=dtype)
        assert same_bits(got[key], want), key
    if device != "cpu":
        ref = _meta(dtype)
        metamat.materialize(ref, device="cpu", seed=7)
        _assert_same(got, _host(ref))


@pytest.mark.parametrize("device", DEVICES)
def test_callable_init_leaves_the_callers_random_streams_alone(device):
    """A callable init (and a module's own reset) runs seeded per tensor, the same numbers
    every time; the caller's CPU and GPU generators are where they were afterwards."""
    if device == "cuda":
        torch.cuda.init()
    cuda = torch.cuda.is_initialized()
    torch.manual_seed(123)
    before_cpu = torch.get_rng_state()
    before_gpu = torch.cuda.get_rng_state() if cuda else None

    def values():
        m = _meta()
        metamat.materialize(m, device=device, seed=7,
                            init={"lin.weight": lambda t: t.normal_(0.0, 0.5)})
        return m.lin.weight.detach().cpu().clone()

    first, second = values(), values()
    assert torch.equal(first, second) and first.std() > 0.3
    assert torch.equal(torch.get_rng_state(), before_cpu)
    if cuda:
        assert torch.equal(torch.cuda.get_rng_state(), before_gpu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_load_equals_the_checkpoint(saved, device, fmt):
    sd, paths = saved
    m = _meta()
    rep = metamat.materialize(m, paths[fmt], device=device, staging_bytes=1 << 20)
    assert _on(m, device) and not rep.initialized
    _assert_same(_host(m), sd)


@pytest.mark.parametrize("device", DEVICES)
def test_load_converts_to_the_models_dtype(saved, device):
    sd, paths = saved
    m = _meta(torch.bfloat16)
    metamat.materialize(m, paths["safetensors"], device=device)
    # the reader rounds to nearest even, as torch's .to(bfloat16)
    _assert_same(_host(m), {k: v.to(torch.bfloat16) for k, v in sd.items()})


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_a_real_model_in_place_after_queued_work(saved, device):
    sd, paths = saved
    torch.manual_seed(5)
    m = Net().to(device)
    before = {k: v.data_ptr() for k, v in m.state_dict().items()}
    w0, b0 = m.lin.weight.detach().clone(), m.lin.bias.detach().clone()
    x = torch.randn(64, 96, device=device)
    if device == "cuda":  # ~1 s of GPU time queued before the next kernel: the load's
        torch.cuda._sleep(2_000_000_000)  # planning and pinning end well inside it
    old = m.lin(x)  # still queued when the load starts: it must see the old weights
    metamat.materialize(m, paths["dcp"], inplace=True)
    assert torch.equal(old, nn.functional.linear(x, w0, b0))
    assert {k: v.data_ptr() for k, v in m.state_dict().items()} == before
    _assert_same(_host(m), sd)


def _dtensor(rank, world, kind, device, paths, sd):
    """A rank of the TP / FSDP2 case: the ``device`` model's local shards, on the host."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU (gloo, not NCCL)
    mesh = init_device_mesh(device, (world,))
    out = {}
    for source in ("init", "safetensors", "dcp"):
        m = _meta()
        if kind == "tp":
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)
            parallelize_module(m, mesh, {"lin": ColwiseParallel(), "wide": ColwiseParallel(),
                                         "narrow": RowwiseParallel()})
        else:
            from torch.distributed.fsdp import fully_shard
            fully_shard(m.lin, mesh=mesh)
            fully_shard(m.wide, mesh=mesh)
            fully_shard(m, mesh=mesh)
        if source == "init":
            metamat.materialize(m, seed=11)  # default device: the mesh's
        else:
            metamat.materialize(m, paths[source])
        local = {}
        for k, v in m.state_dict().items():
            assert v.device.type == device, (k, v.device)
            local[k] = getattr(v, "_local_tensor", v).detach().to("cpu")
        out[source] = local
        if device == "cpu":  # the reference half: whole tensors equal the truth
            want = sd if source != "init" else _plain_init(seed=11)
            for k, v in m.state_dict().items():
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                assert same_bits(full.detach(), want[k]), (kind, source, k)
    return out


def _plain_init(seed: int) -> dict:
    """The unsharded model's init: a sharded model's values are the same (plan-invariant)."""
    m = _meta()
    metamat.materialize(m, device="cpu", seed=seed)
    return _host(m)


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["tp", "fsdp2"])
def test_dtensor_local_shards_equal_the_cpu(saved, kind, device):
    sd, paths = saved
    got = run_dist(_dtensor, 2, kind, device, paths, sd)  # "cpu": checked against the truth
    if device == "cpu":
        return
    want = run_dist(_dtensor, 2, kind, "cpu", paths, sd)
    for g, w in zip(got, want):
        for source in g:
            _assert_same(g[source], w[source])
