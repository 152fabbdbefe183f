"""materialize_dtensor on FSDP2 (``fully_shard``) models built on meta, 2 gloo ranks.

Init and load, then a forward/backward and one optimizer step, compared with the same step on
an unsharded model; FSDP must adopt metamat's padded shard storage without a copy. A module
with no fused init goes through its own ``reset_parameters()`` on a tensor of the global shape
(the same values as unsharded, no warning).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from _dist import run_dist

pytestmark = pytest.mark.multiprocess


class Scale(nn.Module):
    """A module metamat has no fused rule for: its reset_parameters() is the fallback."""

    def __init__(self, n, device=None):
        super().__init__()
        self.g = nn.Parameter(torch.empty(n, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.g.fill_(2.0)

    def forward(self, x):
        return x * self.g


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.l1 = nn.Linear(5, 7, device=device)   # 7 rows over 2 ranks: uneven, padded
        self.l2 = nn.Linear(7, 4, device=device)
        self.norm = nn.LayerNorm(4, device=device)
        self.scale = Scale(4, device=device)

    def forward(self, x):
        return self.scale(self.norm(self.l2(torch.relu(self.l1(x))))).pow(2).mul(x[:, :4]).sum()


def _shard(m):
    from torch.distributed.fsdp import fully_shard
    for sub in (m.l1, m.l2):
        fully_shard(sub)
    fully_shard(m)
    return m


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _step(m, x):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = m(x)
    loss.backward()
    opt.step()
    return {k: _full(v).clone() for k, v in m.named_parameters()}


def _fsdp(rank, world, d):
    import torch.distributed as dist
    from safetensors.torch import save_file

    import metamat
    from metamat import materialize as materialize_dtensor

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("init", "load"):
        ref = Net(device="meta")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            materialize_dtensor(ref, seed=4)  # the unsharded model (plain meta tensors)
        full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        if mode == "load":
            full = {k: v + 0.25 for k, v in full.items()}  # differs from init
            if rank == 0:
                save_file(full, os.path.join(d, "net.safetensors"))
            dist.barrier()
            ref.load_state_dict(full)
        m = _shard(Net(device="meta"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rep = materialize_dtensor(m, None if mode == "init" else
                                      os.path.join(d, "net.safetensors"), seed=4)
        assert not [w for w in caught if "reset_parameters" in str(w.message)]
        if mode == "init":
            assert rep.sources["scale.g"].startswith("reset: Scale.reset_parameters()")
        got = {k: _full(v) for k, v in m.state_dict().items()}
        assert all(torch.equal(got[k], full[k]) for k in full), mode
        if mode == "init":
            assert torch.equal(got["scale.g"], torch.full((4,), 2.0))
            b = 1 / 5 ** 0.5
            w = torch.empty(7, 5)
            metamat.fill_(w, metamat.Uniform(-b, b), seed=4, key="l1.weight")
            assert torch.equal(got["l1.weight"], w)
        # FSDP adopted our padded storage: no copy, padding rows zero.
        fp = m.l1._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        local = m.l1.weight._local_tensor
        assert fp._sharded_param_data.data_ptr() == local.data_ptr()
        assert fp._sharded_param_data.numel() == 4 * 5 and local.shape[0] == (4 if rank == 0 else 3)
        if rank == 1:
            assert torch.equal(fp._sharded_param_data[15:], torch.zeros(5))
        after = _step(m, x)
        want = _step(ref, x)
        for k in want:
            torch.testing.assert_close(after[k], want[k], rtol=1e-5, atol=1e-6)
        assert not torch.equal(after["l1.weight"], full["l1.weight"])
        out[mode] = rep.bytes_written
    return out


def test_fsdp2_init_load_step(tmp_path):
    res = run_dist(_fsdp, 2, str(tmp_path))
    assert all(r["init"] > 0 and r["load"] > 0 for r in res)
