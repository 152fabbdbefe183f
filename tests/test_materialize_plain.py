"""metamat.materialize on plain nn.Modules holding meta tensors (no TorchRec, no process group)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import metamat
from metamat.materialize import materialize
from metamat.report import Report
from metamat.spec import Normal, Uniform


class Net(nn.Module):
    def __init__(self, device="meta"):
        super().__init__()
        self.emb = nn.Embedding(50, 8, device=device)
        self.lin = nn.Linear(8, 4, device=device)
        self.bn = nn.BatchNorm1d(4, device=device)
        self.head = nn.Linear(4, 50, bias=False, device=device)
        self.register_buffer("scale", torch.empty(4, device=device))


def _no_meta(m: nn.Module) -> bool:
    return all(t.device.type != "meta" for t in list(m.parameters()) + list(m.buffers()))


def test_materialize_plain_module_runs_and_is_deterministic():
    a, b = Net(), Net()
    rep = materialize(a, device="cpu", seed=3)
    materialize(b, device="cpu", seed=3)
    assert isinstance(rep, Report) and _no_meta(a)
    assert rep.bytes_written == sum(t.numel() * t.element_size()
                                    for t in list(a.parameters()) + list(a.buffers()))
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
    c = Net()
    materialize(c, device="cpu", seed=4)
    assert not torch.equal(a.lin.weight, c.lin.weight)
    # reset_parameters semantics: BN weight ones, running_var ones, plain buffer zeros
    assert torch.equal(a.bn.weight, torch.ones(4))
    assert torch.equal(a.bn.running_var, torch.ones(4))
    assert torch.equal(a.scale, torch.zeros(4))
    bound = 1 / 8 ** 0.5
    assert a.lin.weight.abs().max() <= bound
    out = a.head(a.bn(a.lin(a.emb(torch.tensor([1, 2, 3])))))
    out.sum().backward()
    assert a.lin.weight.grad is not None


def test_init_overrides_use_fused_engine():
    net = Net()
    materialize(net, device="cpu", seed=5, init={"emb.*": Normal(0.0, 0.5), "lin.bias": Uniform(-1, 1)})
    ref = torch.empty(50, 8)
    metamat.fill_(ref, Normal(0.0, 0.5), seed=5, key="emb.weight")
    assert torch.equal(net.emb.weight.detach(), ref)
    ref_b = torch.empty(4)
    metamat.fill_(ref_b, Uniform(-1, 1), seed=5, key="lin.bias")
    assert torch.equal(net.lin.bias.detach(), ref_b)


def test_tied_weights_stay_tied():
    net = Net()
    net.head.weight = net.emb.weight  # tie (same Parameter in two modules)
    materialize(net, device="cpu")
    assert net.head.weight is net.emb.weight
    assert net.head.weight.device.type == "cpu"


def test_views_keep_aliasing():
    class V(nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = nn.Parameter(torch.empty(20, device="meta"))
            self.part = self.flat.detach()[5:15].view(2, 5)  # hidden alias, not a param

        def reset_parameters(self):
            with torch.no_grad():
                self.flat.copy_(torch.arange(20.0))

    v = V()
    materialize(v, device="cpu")
    assert v.part.data_ptr() == v.flat.data_ptr() + 5 * 4
    assert torch.equal(v.part, torch.arange(5.0, 15.0).view(2, 5))


def test_missing_reset_is_clear_error_and_leaves_model_unchanged():
    from metamat.torchrec.compat import UnsupportedError

    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2, device="meta")
            self.w = nn.Parameter(torch.empty(3, device="meta"))

    m = NoReset()
    with pytest.raises(UnsupportedError, match="'w'.*reset_parameters"):
        materialize(m, device="cpu")
    assert m.w.device.type == "meta" and m.lin.weight.device.type == "meta"
    materialize(m, device="cpu", init={"w": Uniform(0, 1)})
    assert _no_meta(m)


def test_missing_ckpt_and_meta_device_rejected():
    import metamat

    net = Net()
    with pytest.raises(metamat.CheckpointError, match="somewhere"):
        materialize(net, ckpt="somewhere")
    assert all(p.device.type == "meta" for p in net.parameters())
    with pytest.raises(ValueError):
        materialize(Net(), device="meta")


def test_report_str_has_phases():
    rep = materialize(Net(), device="cpu")
    s = str(rep)
    for p in ("plan", "allocate", "fill", "register", "GB/s"):
        assert p in s


def test_materialize_logs_one_info_line(caplog):
    import logging

    m = torch.nn.Linear(8, 4, device="meta")
    with caplog.at_level(logging.INFO, logger="metamat"):
        metamat.materialize(m, device="cpu")
    lines = [r for r in caplog.records if r.name == "metamat" and r.levelno == logging.INFO]
    assert len(lines) == 1 and "initialised" in lines[0].getMessage()
