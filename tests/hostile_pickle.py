"""Hostile pickles (reliability round 3): DCP ``.metadata`` and torch.save ``data.pkl`` that
try to run code, change the unpickler's own objects for later loads, or exhaust memory.

Each payload that would run code creates the file ``PWNED`` next to the checkpoint it sits in
(:func:`marker`): a test asserts the named error *and* that the file does not exist.
:func:`variants` joins the hostile corpus (``hostile_gen.all_variants``); :func:`seeds` gives
the fuzz harness ``fuzz/fuzz_pickle.py`` its starting inputs.
"""
from __future__ import annotations

import os
import pickle
import pickletools
import struct
from typing import Callable, Dict, List

MARKER = "PWNED"


def marker(p: str) -> str:
    """The file a payload aimed at checkpoint ``p`` (a file or a directory) would create."""
    return os.path.join(os.path.dirname(os.path.abspath(p)), MARKER)


class _Call:
    """Pickles as ``fn(*args)`` (REDUCE of a GLOBAL)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _ops(obj, protocol: int = 2) -> bytes:
    """The opcodes that push ``obj``, without PROTO or STOP and without memo writes (so they
    can go in front of another pickle without shifting its memo indices)."""
    raw = pickletools.optimize(pickle.dumps(obj, protocol=protocol))
    assert raw[:1] == b"\x80" and raw[-1:] == b"."
    return raw[2:-1]


def system_payload(path: str, target: str = "") -> bytes:
    """A whole pickle: ``os.system("touch <marker>")`` (``target``: that file instead)."""
    return b"\x80\x02" + _ops(_Call(os.system, f"touch {target or marker(path)}")) + b"."


def exec_payload(path: str, target: str = "") -> bytes:
    """A whole pickle: ``builtins.exec("open(<marker>, 'w')")``."""
    t = target or marker(path)
    return b"\x80\x02" + _ops(_Call(exec, f"open({t!r}, 'w').close()")) + b"."


def in_front(path: str, genuine: bytes, target: str = "") -> bytes:
    """``os.system(...)``, its result popped, then the genuine pickle: plain ``pickle.load``
    runs the command and returns the genuine object, silently."""
    cmd = f"touch {target or marker(path)}"
    return b"\x80\x02" + _ops(_Call(os.system, cmd)) + b"0" + genuine


def dotted_payload(path: str, module: str, target: str = "") -> bytes:
    """``module.os.system`` through a dotted name: protocol 4's STACK_GLOBAL resolves
    ``getattr(getattr(module, "os"), "system")`` in plain pickle."""
    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b
    cmd = f"touch {target or marker(path)}".encode()
    return (b"\x80\x04" + s(module) + s("os.system") + b"\x93"
            + b"X" + struct.pack("<I", len(cmd)) + cmd + b"\x85R.")


def inst_payload(path: str, target: str = "") -> bytes:
    """Protocol 0's INST: ``os.system`` named inline, called with the marked arguments."""
    return b"(S'touch " + (target or marker(path)).encode() + b"'\nios\nsystem\n."


def memo_bomb(index: int = 1 << 28) -> bytes:
    """LONG_BINPUT of a huge index: CPython grows its memo array to twice that and zeroes it
    (4 GiB and ~10 s for 2**28), from 10 bytes."""
    return b"\x80\x02N" + b"r" + struct.pack("<I", index) + b"."


def ext_payload() -> bytes:
    """EXT1 0x7a: an extension-registry code (resolved via copyreg, past find_class)."""
    return b"\x80\x02\x82\x7a."


def build_on(module: str, name: str, attr: str, value_ops: bytes) -> bytes:
    """GLOBAL module.name, then BUILD with slot state {attr: value}: ``setattr`` on the global
    object itself, for every later load in the process."""
    a = attr.encode()
    return (b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n"
            + b"N}X" + struct.pack("<I", len(a)) + a + value_ops + b"s\x86b.")


def persid_payload() -> bytes:
    """A persistent id, which DCP metadata never holds."""
    return b"\x80\x02X\x03\x00\x00\x00abcQ."


def _genuine_md(d: str) -> bytes:
    with open(os.path.join(d, ".metadata"), "rb") as f:
        return f.read()


def _write(p: str, b: bytes) -> None:
    with open(p, "wb") as f:
        f.write(b)


def _md(fn: Callable[[str, bytes], bytes]):
    """Replace ``.metadata`` with ``fn(dir, genuine bytes)``; the error names .metadata."""
    def m(d):
        _write(os.path.join(d, ".metadata"), fn(d, _genuine_md(d)))
        return ".metadata"
    return m


def shared_chunk_lists(d: str, tensors: int = 200, refs: int = 50_000) -> bytes:
    """Genuine metadata plus ``tensors`` entries sharing one list of ``refs`` references to
    one chunk (each with its storage entry): ~0.5 MB listing 10**7 chunks."""
    import dataclasses
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(d).read_metadata()  # the genuine file: the test's own, trusted
    emb = md.state_dict_metadata["emb"]
    key, info = next((k, v) for k, v in md.storage_data.items() if k.fqn == "emb")
    shared = dataclasses.replace(emb, chunks=[emb.chunks[0]] * refs)
    for i in range(tensors):
        md.state_dict_metadata[f"t{i}"] = shared
        md.storage_data[dataclasses.replace(key, fqn=f"t{i}")] = info
    return pickle.dumps(md)


def _drop_offset(md) -> None:
    """Found by fuzz_pickle: a storage entry whose pickle never set ``offset``."""
    info = next(v for k, v in md.storage_data.items() if k.fqn == "emb")
    del info.offset


def variants() -> List:
    """The hostile-pickle variants of the corpus (see ``hostile_gen.Variant``)."""
    import hostile_gen as H

    def ts(fn: Callable[[str], bytes]):
        return lambda p: H._ts_pickle(fn(p))(p)

    U, I = "UnsafePickleError", "InvalidHeaderError"
    md_mod = "torch.distributed.checkpoint.metadata"
    v = [
        H._dcp_var("md_pickle_os_system", _md(lambda d, g: system_payload(d)), exc=U),
        H._dcp_var("md_pickle_exec", _md(lambda d, g: exec_payload(d)), exc=U),
        H._dcp_var("md_pickle_payload_in_front", _md(lambda d, g: in_front(d, g)), exc=U),
        H._dcp_var("md_pickle_dotted_global", _md(lambda d, g: dotted_payload(d, md_mod)),
                   exc=U),
        H._dcp_var("md_pickle_inst", _md(lambda d, g: inst_payload(d)), exc=U),
        H._dcp_var("md_pickle_memo_bomb", _md(lambda d, g: memo_bomb()), exc=U),
        H._dcp_var("md_pickle_ext_code", _md(lambda d, g: ext_payload()), exc=U),
        H._dcp_var("md_pickle_persistent_id", _md(lambda d, g: persid_payload()), exc=U),
        H._dcp_var("md_pickle_build_on_class", _md(lambda d, g: build_on(
            md_mod, "Metadata", "__eq__", b"N")), exc=U),
        H._dcp_var("md_pickle_build_on_enum", _md(lambda d, g: b"\x80\x02c" + md_mod.encode()
                   + b"\n_MEM_FORMAT_ENCODING\nK\x00\x85R}X\x07\x00\x00\x00_value_K\x07sb."),
                   exc=U),
        H._dcp_var("md_pickle_torch_load", _md(lambda d, g: b"\x80\x02ctorch\nload\n."),
                   exc=U),
        H._dcp_var("md_shared_chunk_lists", _md(lambda d, g: shared_chunk_lists(d)), exc=I),
        # found by fuzz_pickle: a Metadata made by NEWOBJ, never given its fields
        H._dcp_var("md_pickle_metadata_without_fields", _md(
            lambda d, g: b"\x80\x02c" + md_mod.encode() + b"\nMetadata\n)\x81."), exc=I),
        H._dcp_var("md_storage_info_without_offset", H._named(
            lambda d: H.dcp_md_edit(d, _drop_offset), ".metadata"), tensor="emb", exc=I),
        H._ts_var("pickle_os_system", ts(system_payload), exc=U),
        H._ts_var("pickle_payload_in_front", ts(lambda p: in_front(p, _ts_data_pkl(p))),
                  exc=U),
        H._ts_var("pickle_inst", ts(inst_payload), exc=U),
        H._ts_var("pickle_dotted_global", ts(lambda p: dotted_payload(p, "torch._utils")),
                  exc=U),
        H._ts_var("pickle_memo_bomb", ts(lambda p: memo_bomb()), exc=U),
        H._ts_var("pickle_ext_code", ts(lambda p: ext_payload()), exc=U),
        H._ts_var("pickle_build_on_function", ts(lambda p: build_on(
            "torch._utils", "_rebuild_tensor_v2", "__defaults__", b"K\x07\x85")), exc=U),
        H._ts_var("pickle_persistent_id_not_storage", ts(lambda p: persid_payload()), exc=U),
    ]
    return v


def _ts_data_pkl(p: str) -> bytes:
    import zipfile
    with zipfile.ZipFile(p) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return z.read(name)


def seeds(bases: Dict[str, str]) -> Dict[str, bytes]:
    """Inputs for ``fuzz/fuzz_pickle.py``: byte 0 even = the rest is DCP ``.metadata``, odd =
    torch.save ``data.pkl``; the genuine pickles and each attack above, whose payloads would
    create ``PWNED`` in the harness's working directory."""
    d, ts = bases["dcp"], bases["ts"]
    md, pkl = _genuine_md(d), _ts_data_pkl(ts)
    t = MARKER
    out = {"md_genuine": md, "pkl_genuine": pkl,
           "md_system": system_payload("", t), "md_exec": exec_payload("", t),
           "md_in_front": in_front("", md, t),
           "md_dotted": dotted_payload("", "torch.distributed.checkpoint.metadata", t),
           "md_memo_bomb": memo_bomb(), "md_ext": ext_payload(),
           "md_build_class": build_on("torch.distributed.checkpoint.metadata", "Metadata",
                                      "__eq__", b"N"),
           "pkl_system": system_payload("", t), "pkl_in_front": in_front("", pkl, t),
           "pkl_inst": inst_payload("", t), "pkl_memo_bomb": memo_bomb(),
           "pkl_build_function": build_on("torch._utils", "_rebuild_tensor_v2",
                                          "__defaults__", b"K\x07\x85")}
    return {k: (b"\x00" if k.startswith("md_") else b"\x01") + v for k, v in out.items()}


if __name__ == "__main__":  # a quick look: python tests/hostile_pickle.py
    for v in variants():
        print(v.name, v.exc)
