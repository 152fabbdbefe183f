"""Restricted unpickling (metamat/checkpoint/unpickle.py, csrc/python/bindings_pickle.cpp): a DCP
``.metadata`` or torch.save ``data.pkl`` never runs what it names, never changes the
unpickler's own objects, never allocates past its size; real DCP checkpoints of every kind
still open; ``trust_pickles=True`` is the documented way back to plain pickle."""
from __future__ import annotations

import copyreg
import io
import os
import pickle
import pickletools
import random
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import hostile_gen
import hostile_pickle as HP
from _dist import run_dist
from metamat.checkpoint import (CheckpointError, InvalidHeaderError, UnsafePickleError,
                                open_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MD = "torch.distributed.checkpoint.metadata"


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "metamat", *map(str, args)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return hostile_gen.make_bases(str(tmp_path_factory.mktemp("bases")))


@pytest.fixture
def dcp_dir(bases, tmp_path):
    import shutil
    d = str(tmp_path / "dcp")
    shutil.copytree(bases["dcp"], d)
    return d


def _set_md(d: str, raw: bytes) -> None:
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(raw)


def _md(d: str) -> bytes:
    with open(os.path.join(d, ".metadata"), "rb") as f:
        return f.read()


# --- the allow-list is what DCP writes --------------------------------------------------------

def _globals_of(raw: bytes) -> set:
    """Every (module, name) a pickle asks find_class for (read by running it: the files are
    the test's own)."""
    seen = set()

    class Rec(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)
    Rec(io.BytesIO(raw)).load()
    return seen


def _save_kinds(rank, world, root):
    """Every kind of entry DCP pickles metadata for, written by two gloo ranks: dense and
    replicated tensors, a row-wise ShardedTensor (TorchRec's tables), a DTensor, bytes and
    object entries, optimizer state; a ``pathlib.Path`` checkpoint id; both serializations."""
    import pathlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, \
        init_from_local_shards
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor
    g = torch.Generator().manual_seed(rank)
    local = torch.randn(4, 3, generator=g)
    st = init_from_local_shards(
        [Shard(local, ShardMetadata([4 * rank, 0], [4, 3], f"rank:{rank}/cpu"))],
        [4 * world, 3])
    mesh = init_device_mesh("cpu", (world,))
    lin = nn.Linear(3, 2)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(1, 3)).sum().backward()
    opt.step()
    sd = {"table": st, "dt": distribute_tensor(torch.arange(16.).view(8, 2), mesh, [DShard(0)]),
          "dense": torch.ones(5, dtype=torch.bfloat16), "ids": torch.arange(3),
          "blob": io.BytesIO(b"abc"),
          "obj": {"step": 3, "name": "x"}, "model": lin.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(pathlib.Path(root) / "ts"))
        dcp.save({k: v for k, v in sd.items() if k in ("table", "dense", "ids")},
                 storage_writer=FileSystemWriter(
                     os.path.join(root, "st"),
                     serialization_format=SerializationFormat.SAFETENSORS))
    return local


def test_allow_list_covers_every_global_dcp_writes(tmp_path):
    from metamat.checkpoint.unpickle import _DCPUnpickler
    locals_ = run_dist(_save_kinds, 2, str(tmp_path))
    up = _DCPUnpickler(io.BytesIO(b""), "x")
    for kind in ("ts", "st"):
        d = str(tmp_path / kind)
        for module, name in _globals_of(_md(d)):
            up.find_class(module, name)  # raises UnsafePickleError if the list lacks it
        ck = open_checkpoint(d)
        assert ck.tensors()["table"].global_shape == (8, 3)
        assert len(ck.tensors()["table"].chunks) == 2
    ck = open_checkpoint(str(tmp_path / "ts"))
    names = set(ck.tensors())
    assert {"dt", "dense", "ids", "model.weight"} <= names
    assert any(n.startswith("optim.state.") and n.endswith("exp_avg") for n in names), names
    # and the values load: the row-wise ShardedTensor, whole
    from metamat.load import load_targets
    from metamat.plan import Target
    dst = torch.empty(8, 3)
    load_targets([Target("table", "table", (8, 3), (0, 0), (8, 3), torch.float32, tensor=dst)],
                 ck, io_threads=1)
    assert torch.equal(dst, torch.cat(locals_))


def test_sealed_classes_are_the_real_ones_to_callers(dcp_dir):
    """isinstance holds, the values are DCP's, TensorProperties decodes its memory format."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

    from metamat.checkpoint.unpickle import load_dcp_metadata
    md = load_dcp_metadata(_md(dcp_dir), "x")
    ref = pickle.loads(_md(dcp_dir))
    assert isinstance(md, Metadata)
    for k, v in ref.state_dict_metadata.items():  # field by field (sealed: another class)
        assert dataclasses.asdict(md.state_dict_metadata[k]) == dataclasses.asdict(v)
    assert {dataclasses.astuple(k): dataclasses.asdict(v) for k, v in md.storage_data.items()} \
        == {dataclasses.astuple(k): dataclasses.asdict(v) for k, v in ref.storage_data.items()}
    props = md.state_dict_metadata["emb"].properties
    assert isinstance(props, TensorProperties) and props.memory_format == torch.contiguous_format
    assert props.layout == torch.strided and props.dtype == torch.float32


# --- code execution ---------------------------------------------------------------------------

PAYLOADS = {
    "os_system": lambda d, g: HP.system_payload(d),
    "exec": lambda d, g: HP.exec_payload(d),
    "in_front_of_genuine": HP.in_front,
    "dotted_name": lambda d, g: HP.dotted_payload(d, MD),
    "inst_opcode": lambda d, g: HP.inst_payload(d),
}


def test_payloads_are_live_under_plain_pickle(dcp_dir):
    """What the tests below refuse really runs with pickle.load (torch's read_metadata) and,
    in front of the genuine metadata, even yields it: the load would succeed, silently."""
    from torch.distributed.checkpoint.metadata import Metadata
    for name, make in PAYLOADS.items():
        raw = make(dcp_dir, _md(dcp_dir))
        got = pickle.loads(raw)
        assert os.path.exists(HP.marker(dcp_dir)), name
        os.remove(HP.marker(dcp_dir))
        if name == "in_front_of_genuine":
            assert isinstance(got, Metadata)


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_metadata_payload_never_runs(dcp_dir, name):
    _set_md(dcp_dir, PAYLOADS[name](dcp_dir, _md(dcp_dir)))
    with pytest.raises(UnsafePickleError) as ei:
        open_checkpoint(dcp_dir)
    assert ".metadata" in str(ei.value) and "trust_pickles=True" in str(ei.value)
    assert ei.value.name and ("system" in ei.value.name or "exec" in ei.value.name)
    assert not os.path.exists(HP.marker(dcp_dir))


def test_materialize_and_cli_refuse_the_payload(dcp_dir):
    import metamat
    _set_md(dcp_dir, HP.in_front(dcp_dir, _md(dcp_dir)))
    net = nn.Linear(2, 2, device="meta")
    with pytest.raises(UnsafePickleError):
        metamat.materialize(net, dcp_dir, device="cpu")
    assert net.weight.is_meta  # nothing was allocated
    for cmd in (("inspect",), ("plan", "--world-size", 2), ("checksum",)):
        r = _cli(cmd[0], dcp_dir, *cmd[1:])
        assert r.returncode == 1, r.stderr
        assert "posix.system" in r.stderr and "--trust-pickles" in r.stderr
        assert "Traceback" not in r.stderr
    assert not os.path.exists(HP.marker(dcp_dir))


class PlannerNote:
    """A class a trusted writer could pickle into the metadata (``planner_data``)."""

    def __init__(self, note: str) -> None:
        self.note = note


def test_trust_pickles_opts_out(dcp_dir):
    """A custom class: refused, named; trust_pickles=True (and --trust-pickles) open it, and
    materialize loads through the opened checkpoint."""
    import dataclasses

    import metamat
    md = pickle.loads(_md(dcp_dir))
    _set_md(dcp_dir, pickle.dumps(dataclasses.replace(md, planner_data=PlannerNote("hi"))))
    with pytest.raises(UnsafePickleError, match="PlannerNote") as ei:
        open_checkpoint(dcp_dir)
    assert ei.value.name.endswith("PlannerNote")
    ck = open_checkpoint(dcp_dir, trust_pickles=True)
    assert set(ck.tensors()) == set(hostile_gen.state())
    net = nn.Module()
    net.emb = nn.Parameter(torch.empty(13, 6, device="meta"))
    metamat.materialize(net, ck, device="cpu", strict=False)
    assert torch.equal(net.emb.detach(), hostile_gen.state()["emb"])
    net2 = nn.Module()  # the same from materialize's own opt-out
    net2.emb = nn.Parameter(torch.empty(13, 6, device="meta"))
    with pytest.raises(UnsafePickleError):
        metamat.materialize(net2, dcp_dir, device="cpu", strict=False)
    assert net2.emb.is_meta
    metamat.materialize(net2, dcp_dir, device="cpu", strict=False, trust_pickles=True)
    assert torch.equal(net2.emb.detach(), hostile_gen.state()["emb"])
    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    assert _cli("inspect", dcp_dir, **env).returncode == 1
    r = _cli("inspect", dcp_dir, "--trust-pickles", **env)
    assert r.returncode == 0 and "emb" in r.stdout, r.stderr


def test_trust_pickles_reaches_torch_save_globals(tmp_path):
    p = str(tmp_path / "m.pt")
    torch.save({"w": torch.ones(3), "note": PlannerNote("x")}, p)
    with pytest.raises(UnsafePickleError, match="PlannerNote"):
        open_checkpoint(p)
    assert set(open_checkpoint(p, trust_pickles=True).tensors()) == {"w"}


# --- torch.save data.pkl: GLOBAL / REDUCE / BUILD / INST / persistent-id tricks ---------------

def test_data_pkl_tricks_never_run(bases, tmp_path):
    import shutil
    for name, make in [("global", HP.system_payload), ("inst", HP.inst_payload),
                       ("front", lambda p: HP.in_front(p, HP._ts_data_pkl(p))),
                       ("dotted", lambda p: HP.dotted_payload(p, "torch._utils"))]:
        p = str(tmp_path / f"{name}.pt")
        shutil.copy(bases["ts"], p)
        hostile_gen._ts_pickle(make(p))(p)
        with pytest.raises(UnsafePickleError, match="system"):
            open_checkpoint(p)
        assert not os.path.exists(HP.marker(p)), name


def test_dcp_blob_unpickler_refuses_the_same_tricks(tmp_path):
    """The data.pkl of every torch.save blob inside a DCP .distcp goes through the same
    unpickler (dcp._unpickled): GLOBAL+REDUCE, INST, OBJ, a dotted name, a non-storage
    persistent id, an EXT code, a memo bomb."""
    from metamat.checkpoint.torch_save import _RestrictedUnpickler
    m = str(tmp_path / "x")
    obj = b"\x80\x02(cposix\nsystem\nX\x05\x00\x00\x00touch" + b"o."
    for raw in (HP.system_payload(m), HP.inst_payload(m), obj,
                HP.dotted_payload(m, "torch._utils"), HP.persid_payload(), HP.ext_payload(),
                HP.memo_bomb()):
        with pytest.raises(UnsafePickleError):
            _RestrictedUnpickler(io.BytesIO(raw), "blob").load()
    assert not os.path.exists(HP.marker(m))


def test_build_cannot_change_the_unpicklers_objects(dcp_dir, bases, tmp_path):
    """A BUILD on an allow-listed function, class or enum member is refused and changes
    nothing for later loads (a plain function's __defaults__ could be rewritten before)."""
    import shutil

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    import metamat.checkpoint.torch_save as ts
    defaults, eq = ts._rebuild_tensor_v2.__defaults__, Metadata.__eq__
    p = str(tmp_path / "m.pt")
    shutil.copy(bases["ts"], p)
    hostile_gen._ts_pickle(HP.build_on("torch._utils", "_rebuild_tensor_v2", "__defaults__",
                                       b"K\x07\x85"))(p)
    with pytest.raises(UnsafePickleError):
        open_checkpoint(p)
    for raw in (HP.build_on(MD, "Metadata", "__eq__", b"N"),
                HP.build_on(MD, "TensorProperties", "__setstate__", b"N")):
        _set_md(dcp_dir, raw)
        with pytest.raises(CheckpointError):
            open_checkpoint(dcp_dir)
    assert ts._rebuild_tensor_v2.__defaults__ == defaults
    assert ts._GLOBALS[("torch._utils", "_rebuild_tensor_v2")]._fn is ts._rebuild_tensor_v2
    assert Metadata.__eq__ is eq
    assert _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0
    assert open_checkpoint(bases["ts"]).tensors()["emb"].global_shape == (13, 6)


# --- memory: memo bombs, extension codes, shared chunk lists ----------------------------------

def test_memo_bomb_is_refused_before_allocating(dcp_dir, bases, tmp_path):
    """10 bytes that make CPython's unpickler zero 4 GiB (2**28 memo slots): refused with
    nothing allocated (the process's peak resident bytes stay where they were; measured in
    bytes, not seconds), in .metadata and in data.pkl."""
    import shutil
    _set_md(dcp_dir, HP.memo_bomb())
    p = str(tmp_path / "m.pt")
    shutil.copy(bases["ts"], p)
    hostile_gen._ts_pickle(HP.memo_bomb())(p)
    for path in (dcp_dir, p):
        before = _reset_peak_rss()
        with pytest.raises(UnsafePickleError, match="memo index 268435456"):
            open_checkpoint(path)
        assert _status_bytes("VmHWM") - before < 256 << 20  # CPython's memo: 2 GiB, zeroed


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) << 10


def _reset_peak_rss() -> int:
    """Reset this process's peak resident bytes (VmHWM) to the current ones, and return them."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def test_extension_codes_are_refused_even_when_registered(dcp_dir):
    copyreg.add_extension("posix", "system", 0x7a)
    try:
        _set_md(dcp_dir, HP.ext_payload())
        with pytest.raises(UnsafePickleError, match="extension registry"):
            open_checkpoint(dcp_dir)
    finally:
        copyreg.remove_extension("posix", "system", 0x7a)


def test_persistent_ids_only_where_the_format_has_them(dcp_dir):
    _set_md(dcp_dir, HP.persid_payload())
    with pytest.raises(UnsafePickleError, match="persistent id"):
        open_checkpoint(dcp_dir)


def test_shared_chunk_lists_are_refused(dcp_dir, monkeypatch):
    """200 tensors sharing one list of 50,000 chunk references: 10**7 chunks from 0.5 MB,
    refused before the walk (which took ~10 s and GBs)."""
    from metamat.checkpoint import dcp
    made = []  # tensor entries and chunks the walk built (counted, not timed)
    for name in ("TensorEntry", "Chunk"):
        real = getattr(dcp, name)
        monkeypatch.setattr(dcp, name, lambda *a, _real=real, **k: made.append(a) or _real(*a, **k))
    open_checkpoint(dcp_dir)
    assert made  # the genuine file is walked: the count sees it
    made.clear()
    _set_md(dcp_dir, HP.shared_chunk_lists(dcp_dir))
    with pytest.raises(InvalidHeaderError, match="chunk lists shared"):
        open_checkpoint(dcp_dir)
    assert made == []


# --- the opcode walk (C++) against pickletools ------------------------------------------------

def _objects():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    big = list(range(300))
    return [None, True, 1, -1, 1 << 70, 1.5, "s", "é" * 300, b"b" * 300, bytearray(b"x"),
            (1,), (1, 2), (1, 2, 3), [big, big], {"a": {1: 2}}, {1, 2}, frozenset({3}),
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])), [[]] * 300]


def _reference(raw: bytes, persistent_ids: bool):
    """pickletools' reading of the same rules: None if accepted, else a reason."""
    puts = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # protocol 0 strings with invalid escapes
        try:
            ops = list(pickletools.genops(raw))
        except ValueError as e:
            return str(e)
    for op, arg, pos in ops:
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            if arg > puts + 1024:
                return "memo"
            puts += 1
        elif op.name == "MEMOIZE":
            puts += 1
        elif op.name in ("EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"):
            return op.name
        elif op.name in ("PERSID", "BINPERSID") and not persistent_ids:
            return op.name
        elif op.name == "PROTO" and arg > 5:
            return "proto"
    return None


def test_scan_accepts_every_genuine_pickle(dcp_dir, bases):
    from metamat._ext import core
    raws = [pickle.dumps(o, protocol=p) for o in _objects() for p in range(6)]
    raws += [_md(dcp_dir), HP._ts_data_pkl(bases["ts"])]
    for raw in raws:
        assert core().pickle_scan(raw, True) == ("", False)
        assert _reference(raw, True) is None


def test_scan_agrees_with_pickletools_on_damaged_pickles():
    """Truncations and random byte changes: whatever the C++ walk accepts, pickletools reads
    to a STOP under the same rules (text arguments it checks more closely are the only
    disagreement allowed: the unpickler then fails with a named error)."""
    from metamat._ext import core
    rng = random.Random(3)
    raws = [pickle.dumps(o, protocol=p) for o in _objects() for p in range(6)]
    n = 0
    for raw in raws:
        cases = [raw[:i] for i in range(len(raw)) if i % 7 == 0 or i == len(raw) - 1]
        for _ in range(40):
            b = bytearray(raw)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            cases.append(bytes(b))
        for c in cases:
            why, refused = core().pickle_scan(c, False)
            ref = _reference(c, False)
            if not why:
                assert ref is None or "arg" in ref or "line" in ref or "decod" in ref \
                    or "string" in ref.lower() or "int" in ref.lower() or "float" in ref, \
                    (c, ref)
            elif refused:
                assert ref is not None, (c, why)
            n += 1
    assert n > 3000


# --- S3: the same unpickler for an object store -----------------------------------------------

def test_s3_metadata_payload_never_runs(dcp_dir, tmp_path):
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    from _s3server import S3Server, upload_dir
    _set_md(dcp_dir, HP.in_front(str(tmp_path / "local"), _md(dcp_dir)))
    srv = S3Server()
    try:
        url = upload_dir(srv, dcp_dir, "evil")
        with pytest.raises(UnsafePickleError, match="posix.system") as ei:
            open_checkpoint(url, storage_options=srv.options(attempts=2, max_retries=1))
        assert url in str(ei.value)
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_ENDPOINT_URL": srv.proxy.url, "AWS_REGION": "us-east-1"}
        r = _cli("inspect", url, **env)
        assert r.returncode == 1 and "posix.system" in r.stderr, r.stderr
        assert not os.path.exists(HP.marker(str(tmp_path / "local")))
    finally:
        srv.stop()


# --- the corpus ------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", HP.variants(), ids=lambda v: v.name)
def test_hostile_pickle_variant_runs_nothing(variant, bases, tmp_path):
    hostile_gen.check_variant(variant, bases, str(tmp_path))
    assert not os.path.exists(os.path.join(str(tmp_path), HP.MARKER))
