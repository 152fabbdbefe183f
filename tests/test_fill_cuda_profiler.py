"""One kernel launch for many tables, counted with the CUDA profiler (GPU only). CUPTI and
compute-sanitizer cannot attach to the same process: scripts/gpu_check.sh runs the sanitizers
with -m "cuda and not cupti"."""
import pytest
import torch

import metamat

pytestmark = [pytest.mark.cuda, pytest.mark.cupti]


@pytest.mark.parametrize("n_tables", [500, 10_000])
def test_one_launch_for_many_tables(n_tables):
    tables = [torch.empty(8 + i % 57, 16 + i % 3 * 8, device="cuda") for i in range(n_tables)]
    dists = [metamat.Uniform(-1, 1), metamat.Normal(), metamat.TruncatedNormal(), metamat.Zeros()]
    items = [(t, dists[i % 4], f"t{i}", 0, 0) for i, t in enumerate(tables)]
    metamat.fill_many_(items)  # warm up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        metamat.fill_many_(items)
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "fill_kernel" in e.name]
    assert len(launches) == 1, [e.name for e in prof.events()]
    for i in (0, 137, n_tables - 1):
        cpu = metamat.fill_(torch.empty(tables[i].shape), dists[i % 4], key=f"t{i}")
        assert torch.equal(tables[i].cpu(), cpu)
