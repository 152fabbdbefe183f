"""metamat.materialize on plain nn.Modules holding meta tensors (no TorchRec, no process group)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import metamat
from metamat import materialize
from metamat.report import Report
from metamat.spec import Constant, Normal, Uniform


class Net(nn.Module):
    def __init__(self, device="meta"):
        super().__init__()
        self.emb = nn.Embedding(50, 8, device=device)
        self.lin = nn.Linear(8, 4, device=device)
        self.bn = nn.BatchNorm1d(4, device=device)
        self.head = nn.Linear(4, 50, bias=False, device=device)
        self.register_buffer("scale", torch.empty(4, device=device))


ZERO = {"scale": metamat.Zeros()}  # Net's plain buffer has no rule: it needs a value


def _no_meta(m: nn.Module) -> bool:
    return all(t.device.type != "meta" for t in list(m.parameters()) + list(m.buffers()))


def test_a_meta_buffer_without_a_value_is_an_error_not_zeros():
    net = Net()
    with pytest.raises(metamat.MissingValueError, match="scale") as ei:
        materialize(net, device="cpu")
    assert ei.value.names == ["scale"]
    assert "init_empty_weights" in str(ei.value)
    assert all(t.device.type == "meta" for t in net.parameters())  # nothing changed


def test_materialize_plain_module_runs_and_is_deterministic():
    a, b = Net(), Net()
    zero = ZERO
    rep = materialize(a, device="cpu", seed=3, init=zero)
    materialize(b, device="cpu", seed=3, init=zero)
    assert isinstance(rep, Report) and _no_meta(a)
    assert rep.bytes_written == sum(t.numel() * t.element_size()
                                    for t in list(a.parameters()) + list(a.buffers()))
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
    c = Net()
    materialize(c, device="cpu", seed=4, init=zero)
    assert not torch.equal(a.lin.weight, c.lin.weight)
    # reset_parameters semantics: BN weight ones, running_var ones; the buffer from init=
    assert torch.equal(a.bn.weight, torch.ones(4))
    assert torch.equal(a.bn.running_var, torch.ones(4))
    assert torch.equal(a.scale, torch.zeros(4))
    assert rep.buffers["scale"] == "init= distribution" and rep.buffers["bn.running_var"] == "rule"
    bound = 1 / 8 ** 0.5
    assert a.lin.weight.abs().max() <= bound
    out = a.head(a.bn(a.lin(a.emb(torch.tensor([1, 2, 3])))))
    out.sum().backward()
    assert a.lin.weight.grad is not None


def test_init_overrides_use_fused_engine():
    net = Net()
    materialize(net, device="cpu", seed=5, init={"emb.*": Normal(0.0, 0.5), "lin.bias": Uniform(-1, 1), **ZERO})
    ref = torch.empty(50, 8)
    metamat.fill_(ref, Normal(0.0, 0.5), seed=5, key="emb.weight")
    assert torch.equal(net.emb.weight.detach(), ref)
    ref_b = torch.empty(4)
    metamat.fill_(ref_b, Uniform(-1, 1), seed=5, key="lin.bias")
    assert torch.equal(net.lin.bias.detach(), ref_b)


def test_tied_weights_stay_tied():
    net = Net()
    net.head.weight = net.emb.weight  # tie (same Parameter in two modules)
    materialize(net, device="cpu", init=ZERO)
    assert net.head.weight is net.emb.weight
    assert net.head.weight.device.type == "cpu"


@pytest.mark.parametrize("base, args", [(nn.Linear, (8, 3)), (nn.Conv1d, (2, 3, 3)),
                                        (nn.Embedding, (5, 4)), (nn.LayerNorm, (4,)),
                                        (nn.BatchNorm1d, (4,))])
def test_a_subclass_tensor_its_reset_leaves_alone_is_missing_not_guessed(base, args):
    class Scaled(base):  # reset_parameters() is base's: it never sets `scale`
        def __init__(self):
            super().__init__(*args, device="meta")
            self.scale = nn.Parameter(torch.ones(3, device="meta"))

    m = Scaled()
    with pytest.raises(metamat.MissingValueError, match=r"'scale'.*neither a known init nor"):
        materialize(m, device="cpu")
    assert m.scale.is_meta and m.weight.is_meta
    materialize(m, device="cpu", init={"scale": Constant(1.0)})  # once named, it works
    assert torch.equal(m.scale, torch.ones(3)) and not m.weight.is_meta


def test_other_references_to_a_parameter_get_the_same_new_object():
    class D(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3, device="meta")
            self.by_name = {"w": self.lin.weight, "b": self.lin.bias}  # e.g. TorchRec's dicts
            self.frozen = (self.lin.weight,)

    d = D()
    with pytest.warns(UserWarning, match=r"frozen\[0\] is held in an immutable container"):
        materialize(d, device="cpu")
    assert d.by_name["w"] is d.lin.weight and d.by_name["b"] is d.lin.bias
    assert d.lin.weight.device.type == "cpu"


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
    from metamat import UnsupportedError

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
    rep = materialize(Net(), device="cpu", init=ZERO)
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


# ------------------------------------------------------------------------------------------
# checkpoints: unexpected tensors, N-D and 0-D parameters


class Small(nn.Module):
    def __init__(self, device="meta"):
        super().__init__()
        self.lin = nn.Linear(3, 2, device=device)
        self.conv = nn.Conv2d(2, 4, kernel_size=3, device=device)  # a 4-D weight
        self.temp = nn.Parameter(torch.empty((), device=device))  # 0-D

        def reset_parameters():
            with torch.no_grad():
                self.temp.fill_(1.0)
        self.reset_parameters = reset_parameters


def _small_state():
    torch.manual_seed(1)
    m = Small(device="cpu")
    with torch.no_grad():
        m.temp.fill_(0.5)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _save_all(sd, d):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    save_file(sd, str(d / "m.safetensors"))
    torch.save(sd, str(d / "m.pt"))
    dcp.save(sd, checkpoint_id=str(d / "dcp"))
    return [str(d / "m.safetensors"), str(d / "m.pt"), str(d / "dcp")]


def test_nd_and_0d_parameters_load_from_every_format(tmp_path):
    sd = _small_state()
    for path in _save_all(sd, tmp_path):
        m = Small()
        rep = materialize(m, path, device="cpu")
        assert sorted(rep.loaded) == sorted(sd), path
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k]), (path, k)


def test_cli_plan_accepts_nd_tensors(tmp_path, capsys):
    from metamat.cli import main

    path = _save_all(_small_state(), tmp_path)[0]
    for sharding in ("row_wise", "column_wise", "table_wise"):
        assert main(["plan", path, "--world-size", "2", "--sharding", sharding]) == 0
    assert "conv.weight" not in capsys.readouterr().err


def test_unexpected_tensors_raise_under_strict_and_are_reported(tmp_path):
    from safetensors.torch import save_file

    sd = _small_state()
    sd["extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "x.safetensors"))
    m = Small()
    with pytest.raises(metamat.UnexpectedTensorError, match="extra.weight") as ei:
        materialize(m, str(tmp_path / "x.safetensors"), device="cpu")
    assert ei.value.names == ["extra.weight"]
    assert all(p.is_meta for p in m.parameters())  # nothing changed
    rep = materialize(m, str(tmp_path / "x.safetensors"), device="cpu", strict=False)
    assert rep.unexpected == ["extra.weight"] and "1 unexpected" in rep.summary()
    m2 = Small()
    rep = materialize(m2, str(tmp_path / "x.safetensors"), device="cpu",
                      ignore_unexpected=["extra.*"])
    assert rep.unexpected == []


def test_optimizer_state_without_a_fused_optimizer_says_so(tmp_path):
    from safetensors.torch import save_file

    sd = {f"model.{k}": v for k, v in _small_state().items()}
    sd["optim.state.lin.weight.exp_avg"] = torch.zeros(2, 3)
    save_file(sd, str(tmp_path / "o.safetensors"))
    with pytest.raises(metamat.UnexpectedTensorError, match="no fused optimizer") as ei:
        materialize(Small(), str(tmp_path / "o.safetensors"), device="cpu")
    assert "ignore_unexpected=['optim.*']" in str(ei.value)
    rep = materialize(Small(), str(tmp_path / "o.safetensors"), device="cpu",
                      ignore_unexpected=["optim.*"])
    assert rep.key_prefixes["model"] == "model." and not rep.unexpected


def test_loading_needs_no_init_rule_for_loaded_tensors(tmp_path):
    """A module with no reset_parameters() and no rule loads when the checkpoint has it all."""
    from safetensors.torch import save_file

    class Norm(nn.Module):  # like LlamaRMSNorm: a parameter, no reset_parameters()
        def __init__(self, device="meta"):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, device=device))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Norm()
            self.lin = nn.Linear(4, 4, device="meta")

    save_file({"norm.weight": torch.arange(4.0), "lin.weight": torch.ones(4, 4),
               "lin.bias": torch.zeros(4)}, str(tmp_path / "n.safetensors"))
    m = M()
    materialize(m, str(tmp_path / "n.safetensors"), device="cpu")
    assert torch.equal(m.norm.weight, torch.arange(4.0))
    with pytest.raises(metamat.MissingValueError, match="norm.weight"):
        materialize(M(), device="cpu")  # without the checkpoint it has no value source


def test_rename_does_not_change_init_values(tmp_path):
    """One path for every model: passing rename= (or not) gives the same values."""
    from safetensors.torch import save_file

    a, b = Net(), Net()
    materialize(a, device="cpu", seed=9, init=ZERO)
    save_file({"x.lin.weight": torch.ones(4, 8)}, str(tmp_path / "r.safetensors"))
    materialize(b, str(tmp_path / "r.safetensors"), device="cpu", seed=9, init=ZERO,
                strict=False, rename={"lin.weight": "x.lin.weight"})
    for k, v in a.state_dict().items():
        want = torch.ones(4, 8) if k == "lin.weight" else v
        assert torch.equal(b.state_dict()[k], want), k
