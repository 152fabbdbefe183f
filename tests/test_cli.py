"""``python -m metamat``: inspect and plan on checkpoints written by torch and safetensors."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    sd = {"ebc.t0.weight": torch.randn(100, 16), "ebc.t1.weight": torch.randn(30, 8),
          "mlp.bias": torch.randn(7)}
    dcp.save(sd, checkpoint_id=str(d / "dcp"))
    save_file(sd, str(d / "m.safetensors"))
    torch.save(sd, d / "m.pt")
    bad = d / "bad.safetensors"
    raw = (d / "m.safetensors").read_bytes()
    bad.write_bytes(raw[: len(raw) // 2])  # truncated: offsets point past the end
    return d


def run(*args):
    """The CLI in a process of its own, forked with torch imported (_dist.run_main);
    test_python_m_metamat_is_the_cli runs ``python -m metamat`` itself."""
    from metamat.cli import main

    from _dist import run_main
    return run_main(main, args)


def test_python_m_metamat_is_the_cli(ckpts):
    def python_m(*args):
        return subprocess.run([sys.executable, "-m", "metamat", *map(str, args)],
                              capture_output=True, text=True, timeout=120)
    r = python_m("inspect", ckpts / "dcp", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["format"] == "dcp", r.stderr
    assert python_m("inspect", ckpts / "bad.safetensors").returncode == 1
    assert python_m("frobnicate").returncode == 2


@pytest.mark.parametrize("name,fmt", [("dcp", "dcp"), ("m.safetensors", "safetensors"),
                                      ("m.pt", "torch_save")])
def test_inspect(ckpts, name, fmt):
    r = run("inspect", ckpts / name, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format"] == fmt
    assert info["tensors"]["ebc.t0.weight"]["shape"] == [100, 16]
    assert info["total_bytes"] == (1600 + 240 + 7) * 4
    text = run("inspect", ckpts / name)
    assert text.returncode == 0 and "ebc.t1.weight" in text.stdout


def test_plan_row_wise_reads_exactly_the_shard(ckpts):
    r = run("plan", ckpts / "dcp", "--world-size", 4, "--sharding", "row_wise", "--json")
    assert r.returncode == 0, r.stderr
    ranks = json.loads(r.stdout)["ranks"]
    assert sum(x["bytes_needed"] for x in ranks.values()) == (1600 + 240 + 7) * 4
    assert all(x["read_amplification"] == 1.0 for x in ranks.values())
    tw = json.loads(run("plan", ckpts / "m.pt", "--world-size", 2, "--sharding", "table_wise",
                        "--rank", 1, "--json").stdout)["ranks"]
    assert list(tw) == ["1"] and tw["1"]["tensors"] == 1


def test_bad_checkpoint_exit_1_names_the_file(ckpts):
    r = run("inspect", ckpts / "bad.safetensors")
    assert r.returncode == 1
    assert "bad.safetensors" in r.stderr


def test_bad_usage_exit_2(ckpts):
    assert run("plan", ckpts / "dcp").returncode == 2
    assert run("plan", ckpts / "dcp", "--world-size", 2, "--rank", 5).returncode == 2
    assert run("frobnicate").returncode == 2


def _copy(ckpts, name, tmp_path):
    import shutil
    src = ckpts / name
    dst = tmp_path / name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def _flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("name", ["dcp", "m.safetensors", "m.pt"])
def test_checksum_write_then_verify(ckpts, tmp_path, name):
    from metamat.checkpoint import open_checkpoint
    from metamat.checkpoint.checksum import read_manifest, sidecar_path

    path = _copy(ckpts, name, tmp_path)
    r = run("checksum", path, "--block-bytes", 1000)
    assert r.returncode == 0, r.stderr
    side = sidecar_path(path)
    line = r.stdout.strip()
    assert line.startswith(f"wrote {side}:") and "3 chunk(s)" in line and "GB/s" in line
    assert f"{(1600 + 240 + 7) * 4 / 1e6:.1f} MB hashed" in line
    m = read_manifest(path)
    assert m.block_bytes == 1000 and len(m.chunks) == 3
    info = json.loads(run("checksum", path, "--verify", "--json").stdout)
    assert info["verified"] and info["manifest"] == side
    assert info["bytes_hashed"] == (1600 + 240 + 7) * 4 and info["gbps"] > 0
    # one flipped byte inside ebc.t0.weight: exit 1 naming file, tensor and byte range
    ch = open_checkpoint(str(path)).tensors()["ebc.t0.weight"].chunks[0]
    _flip(ch.file, ch.byte_offset + 4321)
    r = run("checksum", path, "--verify")
    assert r.returncode == 1
    assert "checksum mismatch" in r.stderr and "'ebc.t0.weight'" in r.stderr
    assert ch.file in r.stderr and f"[{ch.byte_offset + 4000}, {ch.byte_offset + 5000})" in r.stderr
    # re-writing the manifest accepts the new bytes
    assert run("checksum", path, "--json").returncode == 0
    assert run("checksum", path, "--verify").returncode == 0


def test_checksum_errors(ckpts, tmp_path):
    path = _copy(ckpts, "m.safetensors", tmp_path)
    r = run("checksum", path, "--verify")  # no manifest yet
    assert r.returncode == 1 and "m.safetensors.xxh3.json" in r.stderr
    assert run("checksum", ckpts / "bad.safetensors").returncode == 1
    assert run("checksum", path, "--block-bytes", 0).returncode == 2
    assert run("checksum", path, "--verify", "--block-bytes", 64).returncode == 2
    assert run("checksum").returncode == 2


# --- reliability round 2: no tracebacks, named errors ----------------------------------------

def _no_traceback(r):
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_unreadable_directory(tmp_path, monkeypatch, capsys):
    from metamat import cli
    d = tmp_path / "ck"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / "m.safetensors"))
    if os.geteuid() != 0:
        os.chmod(d, 0)
        try:
            r = run("inspect", d)
        finally:
            os.chmod(d, 0o755)
        assert r.returncode == 1 and str(d) in r.stderr
        _no_traceback(r)
    real = os.listdir

    def refuse(p="."):  # as root permissions do not stop listing: refuse it like the OS
        if os.fspath(p) == str(d):
            raise PermissionError(13, "Permission denied", str(p))
        return real(p)
    monkeypatch.setattr(os, "listdir", refuse)
    assert cli.main(["inspect", str(d)]) == 1
    err = capsys.readouterr().err
    assert "cannot list checkpoint directory" in err and str(d) in err


def test_special_files_exit_1(tmp_path):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    zero = tmp_path / "z.pt"
    os.symlink("/dev/zero", zero)
    for p in (fifo, zero):
        for args in (("inspect", p), ("checksum", p), ("checksum", p, "--verify")):
            r = run(*args)  # a hang would hit run()'s timeout
            assert r.returncode == 1, (args, r.stderr)
            _no_traceback(r)


def test_json_int_over_digit_limit(tmp_path):
    import struct
    hdr = b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'
    p = tmp_path / "big.safetensors"
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 4)
    r = run("inspect", p)
    assert r.returncode == 1 and "PYTHONINTMAXSTRDIGITS" in r.stderr
    _no_traceback(r)


def test_checksum_write_failures_leave_nothing(ckpts, tmp_path):
    """The sidecar path is a directory: exit 1 naming it, no *.tmpPID left behind."""
    path = _copy(ckpts, "m.safetensors", tmp_path)
    (tmp_path / "m.safetensors.xxh3.json").mkdir()
    r = run("checksum", path)
    assert r.returncode == 1 and "cannot write" in r.stderr and "xxh3.json" in r.stderr
    _no_traceback(r)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_checksum_verify_hostile_sidecar(ckpts, tmp_path):
    """A sidecar naming a file outside the directory: exit 1, nothing hashed or printed."""
    (tmp_path / "ck").mkdir()
    path = _copy(ckpts, "m.safetensors", tmp_path / "ck")
    (tmp_path / "secret.txt").write_text("do not print me")
    assert run("checksum", path).returncode == 0
    side = tmp_path / "ck" / "m.safetensors.xxh3.json"
    d = json.loads(side.read_text())
    d["files"] = {"../secret.txt": 15}
    d["chunks"] = [{**d["chunks"][0], "file": "../secret.txt", "byte_offset": 0, "nbytes": 15,
                    "blocks": ["0" * 16]}]
    side.write_text(json.dumps(d))
    r = run("checksum", path, "--verify")
    assert r.returncode == 1 and "leaves the checkpoint directory" in r.stderr
    assert "do not print me" not in r.stderr + r.stdout
    _no_traceback(r)


# --- reliability round 3: large worlds are bounded and summarised ----------------------------

def test_world_size_above_the_limit_is_bad_usage(ckpts):
    r = run("plan", ckpts / "dcp", "--world-size", 10**9)
    assert r.returncode == 2 and "METAMAT_MAX_WORLD_SIZE" in r.stderr and "1048576" in r.stderr
    _no_traceback(r)
    r = subprocess.run([sys.executable, "-m", "metamat", "plan", str(ckpts / "dcp"),
                        "--world-size", "11"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, METAMAT_MAX_WORLD_SIZE="10"))
    assert r.returncode == 2 and "[1, 10]" in r.stderr
    assert run("plan", ckpts / "dcp", "--world-size", 0).returncode == 2


def test_a_million_ranks_is_a_summary(ckpts):
    """10**6 ranks printed a million lines (and 10**9 raised MemoryError): the first and last
    8 ranks, what was left out, and totals."""
    r = run("plan", ckpts / "dcp", "--world-size", 10**6)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) < 25
    assert "999984 rank(s) not shown (not planned" in r.stdout
    assert lines[-1].startswith("total over the 16 ranks shown")
    assert "999999" in r.stdout
    info = json.loads(run("plan", ckpts / "dcp", "--world-size", 10**6, "--json").stdout)
    assert len(info["ranks"]) == 16 and info["totals"]["all_ranks"] is False


def test_a_large_worlds_plan_costs_what_its_ranks_shown_cost(ckpts, monkeypatch, capsys):
    """Planning 10**6 ranks plans the 16 it shows, and the whole command does the same work
    as for 10**4 ranks (counted: Python lines and calls; a clock said "< 60 s" before)."""
    from metamat import cli

    from _work import count_work

    planned = []
    real = cli.plan_reads
    monkeypatch.setattr(cli, "plan_reads", lambda *a, **k: planned.append(1) or real(*a, **k))
    work = {}
    for world in (10**4, 10**6, 10**4):  # the first call warms caches and imports
        planned.clear()
        rc, work[world] = count_work(cli.main, ["plan", str(ckpts / "dcp"), "--world-size",
                                                str(world), "--json"])
        assert rc == 0 and len(planned) == 16
        assert len(json.loads(capsys.readouterr().out)["ranks"]) == 16
    assert work[10**6].total <= 1.01 * work[10**4].total, work


def test_a_medium_world_is_planned_whole_and_shown_in_part(ckpts):
    r = run("plan", ckpts / "dcp", "--world-size", 40)
    assert r.returncode == 0, r.stderr
    assert "24 rank(s) not shown (in the totals" in r.stdout
    assert f"total over all 40 ranks: {(1600 + 240 + 7) * 4 / 1e6:.2f} MB needed" in r.stdout
    info = json.loads(run("plan", ckpts / "dcp", "--world-size", 40, "--json").stdout)
    assert len(info["ranks"]) == 40 and info["totals"]["all_ranks"]
    assert info["totals"]["bytes_needed"] == (1600 + 240 + 7) * 4
    one = json.loads(run("plan", ckpts / "dcp", "--world-size", 10**6, "--rank", 999_999,
                         "--json").stdout)
    assert list(one["ranks"]) == ["999999"]
