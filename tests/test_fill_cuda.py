"""CUDA backend: same values as the CPU engine, one launch for many tables (GPU only)."""
import pytest
import torch

import metamat
from conftest import bits

pytestmark = pytest.mark.cuda

DISTS = [metamat.Uniform(-1, 1), metamat.Normal(0, 1), metamat.TruncatedNormal(), metamat.Constant(2)]


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: type(d).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_cuda_equals_cpu(dist, dtype):
    for cols, c0 in [(1, 0), (33, 31), (64, 0), (65, 63), (300, 5)]:
        g = torch.full((37, cols), float("nan"), dtype=dtype, device="cuda")
        c = torch.full((37, cols), float("nan"), dtype=dtype)
        metamat.fill_(g, dist, seed=4, key="t", row_offset=11, col_offset=c0)
        metamat.fill_(c, dist, seed=4, key="t", row_offset=11, col_offset=c0)
        assert torch.equal(bits(g.cpu()), bits(c)), (cols, c0)


def test_cuda_strided_and_1d():
    base = torch.full((9, 100), float("nan"), device="cuda")
    metamat.fill_(base[2:7, 3:90], metamat.Normal(), key="s", row_offset=2, col_offset=3)
    cpu = torch.full((9, 100), float("nan"))
    metamat.fill_(cpu[2:7, 3:90], metamat.Normal(), key="s", row_offset=2, col_offset=3)
    assert torch.equal(bits(base.cpu()), bits(cpu))
    v = metamat.fill_(torch.empty(1000, device="cuda"), metamat.Uniform(), key="v", col_offset=7)
    assert torch.equal(v.cpu(), metamat.fill_(torch.empty(1000), metamat.Uniform(), key="v", col_offset=7))


def test_one_launch_for_many_tables():
    tables = [torch.empty(64, 48, device="cuda") for _ in range(500)]
    items = [(t, metamat.Uniform(-1, 1), f"t{i}", 0, 0) for i, t in enumerate(tables)]
    metamat.fill_many_(items)  # warm up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        metamat.fill_many_(items)
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "fill_kernel" in e.name]
    assert len(launches) == 1, [e.name for e in prof.events()]
    for i in (0, 137, 499):
        cpu = metamat.fill_(torch.empty(64, 48), metamat.Uniform(-1, 1), key=f"t{i}")
        assert torch.equal(tables[i].cpu(), cpu)
