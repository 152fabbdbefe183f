"""Which GPU ``materialize`` fills: this rank's (``cuda:LOCAL_RANK`` under torchrun, whether or
not ``torch.cuda.set_device`` was called), the one a TorchRec model was laid out for, and never
another one. The GPU queries are stood in for where no GPU is (torch.cuda's availability,
device count and current device: nothing else of CUDA runs)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from metamat.emulation import emulated_cuda
from metamat.errors import UnsupportedError
from metamat.models.device import resolve_device, this_ranks_gpu


@pytest.fixture
def four_gpus(monkeypatch):
    """torch sees 4 GPUs, cuda:0 current (no set_device called)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return monkeypatch


def _meta_linear(laid=None):
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    if laid is not None:
        m._metamat_compute_device = torch.device(laid)
    return m


def test_this_ranks_gpu_is_local_rank_else_current(four_gpus):
    assert this_ranks_gpu(torch.device("cuda")) == torch.device("cuda", 0)
    four_gpus.setenv("LOCAL_RANK", "2")
    assert this_ranks_gpu(torch.device("cuda")) == torch.device("cuda", 2)
    assert this_ranks_gpu(torch.device("cuda", 3)) == torch.device("cuda", 3)  # explicit
    four_gpus.setenv("LOCAL_RANK", "5")  # CUDA_VISIBLE_DEVICES left fewer GPUs than ranks
    assert this_ranks_gpu(torch.device("cuda")) == torch.device("cuda", 0)


def test_a_gpu_chosen_with_set_device_wins_over_local_rank(four_gpus):
    """set_device(3) on local rank 1 (a second job on the node's other GPUs): cuda:3, where
    FSDP2, DeviceMesh and TorchRec's own streams work too."""
    four_gpus.setenv("LOCAL_RANK", "1")
    four_gpus.setattr(torch.cuda, "current_device", lambda: 3)
    assert this_ranks_gpu(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device(_meta_linear(), "cuda") == (torch.device("cuda", 3), False)


def test_cuda_without_index_is_this_ranks_gpu_not_the_current_one(four_gpus):
    four_gpus.setenv("LOCAL_RANK", "1")
    assert resolve_device(_meta_linear(), "cuda") == (torch.device("cuda", 1), False)
    assert resolve_device(_meta_linear(), None) == (torch.device("cuda", 1), False)
    assert resolve_device(_meta_linear(), "cuda:3") == (torch.device("cuda", 3), False)


def test_cuda_without_index_is_the_gpu_the_tables_were_laid_out_for(four_gpus):
    four_gpus.setenv("LOCAL_RANK", "0")
    m = _meta_linear(laid="cuda:2")  # shard_on_meta(compute_device="cuda:2")
    assert resolve_device(m, "cuda") == (torch.device("cuda", 2), False)
    assert resolve_device(m, None) == (torch.device("cuda", 2), False)
    assert resolve_device(m, "cuda:2") == (torch.device("cuda", 2), False)


def test_another_gpu_than_the_layouts_is_refused(four_gpus):
    m = _meta_linear(laid="cuda:2")
    with pytest.raises(UnsupportedError, match=r"cuda:0 asked for.*laid out for cuda:2"):
        resolve_device(m, "cuda:0")
    with pytest.raises(UnsupportedError, match="laid out for cuda:2"), emulated_cuda():
        resolve_device(m, torch.device("cuda", 1))  # refused before the emulation too


def test_emulated_device_and_a_layout_without_index():
    """Where no GPU is visible shard_on_meta records plain ``cuda``: any CUDA device is the
    emulated one."""
    m = _meta_linear(laid="cuda")
    with emulated_cuda():
        for asked in (None, "cuda", "cuda:0", "cuda:1"):
            assert resolve_device(m, asked) == (torch.device("cpu"), True)
    with pytest.raises(UnsupportedError, match="torch sees no CUDA device"):
        resolve_device(m, "cuda")


def test_dense_tensors_that_do_not_fit_the_gpu_are_refused_before_allocation():
    """Every part's device memory is checked before anything is allocated (not only TorchRec
    tables): DeviceMemoryError, the model left on meta; with room, the same call works."""
    import metamat

    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))
    need = sum(p.numel() * 4 for p in m.parameters())
    why = rf"need {need:,} bytes .*\(4 storages\) and {need - 1:,} bytes are free"
    with emulated_cuda(free_memory=need - 1), pytest.raises(metamat.DeviceMemoryError,
                                                            match=why):
        metamat.materialize(m, device="cuda", seed=0)
    assert all(p.is_meta for p in m.parameters())
    with emulated_cuda(free_memory=need):
        metamat.materialize(m, device="cuda", seed=0)
    assert not any(p.is_meta for p in m.parameters())

