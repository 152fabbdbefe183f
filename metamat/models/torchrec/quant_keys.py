"""Quantized tables in a checkpoint: what each table block takes, float or quantized.

Per table (its weight key, ``<module>.embedding_bags.<name>.weight``, with the checkpoint's
model prefix), by the saved dtype:

* float32/float16/bfloat16 (a training checkpoint): INT8/INT4/INT2 blocks become
  :class:`~metamat.load.quantize.QuantJob` s (whole float rows read into the scratch buffer and
  quantized into place; the column-wise shards of one row range share a job, so every shard
  gets the scale/bias of the whole row, as TorchRec's CW quant sharding does); FP16/FP32
  blocks become plain targets (typed views of the TBE rows: the reader converts as it
  copies). The ``weight_qscale``/``weight_qbias`` state of split-mode modules is derived.
* uint8 (a quantized model's own ``state_dict``): bytes copied as they are, from either of
  TorchRec's formats: split (``weight`` holds the data, ``weight_qscale``/``weight_qbias``
  the fp16 scale and bias) or whole rows (``weight`` holds fbgemm's rows, scale/bias
  included, padded to any alignment). INT4/INT2 weights are saved as their uint8 bytes
  (``(rows, dim * bits / 8)``, what TorchRec's ``UInt4Tensor``/``UInt2Tensor`` hold). A
  column-wise sharded model's own state has one ``weight_qscale.<i>``/``weight_qbias.<i>`` per
  column shard: it reloads into the same column split.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Set, Tuple

import torch

from ...checkpoint.errors import DtypeMismatchError, MissingTensorError, ShapeMismatchError
from ...errors import UnsupportedError
from ...load.quantize import INT_KINDS, QuantJob, QuantOut
from ...plan import Target, storage_key
from .quant import QuantTable

__all__ = ["QuantMatch", "match_quant"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class QuantMatch:
    """What the checkpoint gives the quantized tables.

    Attributes:
        load: plain targets for the loader (fqn = the name ``keys`` maps).
        keys: those names -> checkpoint keys.
        jobs: quantized loads of float rows.
        used: checkpoint keys taken.
        tables: fqns of the tables the checkpoint provides.
    """

    load: List[Target] = dataclasses.field(default_factory=list)
    keys: Dict[str, str] = dataclasses.field(default_factory=dict)
    jobs: List[QuantJob] = dataclasses.field(default_factory=list)
    used: Set[str] = dataclasses.field(default_factory=set)
    tables: Set[str] = dataclasses.field(default_factory=set)


def byte_view(t: QuantTable, col_byte: int, nbytes: int, dtype=torch.uint8) -> torch.Tensor:
    """A meta view of ``nbytes`` bytes of each of ``t``'s rows, from byte ``col_byte`` of the
    row, as ``dtype`` elements ((rows, nbytes / itemsize), row stride in elements)."""
    isz = dtype.itemsize
    start = t.offset + col_byte
    if start % isz or t.stride % isz or nbytes % isz:
        raise UnsupportedError(f"{t.fqn}: rows of {t.stride} bytes at {t.offset} cannot be "
                               f"viewed as {dtype}")
    v = torch.empty((0,), dtype=dtype, device="meta")
    return v.set_(t.storage.untyped_storage(), start // isz, (t.rows, nbytes // isz),
                  (t.stride // isz, 1))


def _job_out(t: QuantTable) -> QuantOut:
    return QuantOut(t.col0, t.cols, t.kind, storage_key(t.storage), t.offset, t.stride,
                    t.sb_last)


def _float_blocks(tables: List[QuantTable], fqn: str, ck: str, shape, m: QuantMatch,
                  path: str) -> None:
    g = tables[0].source_shape  # a pruned table reads the first of the float rows
    if tuple(shape) != tuple(g):
        raise ShapeMismatchError(f"checkpoint shape {tuple(shape)} != model table shape "
                                 f"{tuple(g)}", file=path, tensor=fqn)
    groups: Dict[Tuple[int, int], List[QuantTable]] = {}
    for t in tables:
        if t.kind in INT_KINDS:
            groups.setdefault((t.row0, t.rows), []).append(t)
            continue
        dt = torch.float16 if t.kind == 16 else torch.float32
        m.load.append(Target(fqn, t.name, tuple(g), (t.row0, t.col0), (t.rows, t.cols), dt,
                             tensor=byte_view(t, 0, t.data_bytes, dt)))
    for (r0, n), ts in groups.items():
        m.jobs.append(QuantJob(fqn, ts[0].name, tuple(g), r0, n, [_job_out(t) for t in ts]))
    m.keys[fqn] = ck


def _raw_blocks(tables: List[QuantTable], fqn: str, ck: str, keys: Mapping[str, object],
                m: QuantMatch, path: str) -> None:
    """A quantized table's bytes, as saved (module docstring)."""
    e = keys[ck]
    shape = tuple(e.global_shape)
    t0 = tables[0]
    nrows, dim = t0.global_shape
    data_w = dim * t0.kind // 8  # bytes of a whole row's data
    base = ck[: -len("weight")]
    qs, qb = base + "weight_qscale", base + "weight_qbias"
    split = t0.kind in INT_KINDS and qs in keys and qb in keys
    # a column-wise sharded model's own state: one scale and bias per row and column shard
    per_shard = t0.kind in INT_KINDS and not split and f"{qs}.0" in keys and f"{qb}.0" in keys
    split = split or per_shard
    if len(shape) != 2 or shape[0] != nrows:
        raise ShapeMismatchError(f"quantized checkpoint shape {shape} does not hold "
                                 f"{nrows} rows of table {t0.name!r}", file=path, tensor=fqn)
    if split or t0.kind not in INT_KINDS:
        data_col = 0
        if shape[1] < data_w:
            raise ShapeMismatchError(f"quantized rows of {shape[1]} bytes; the model's "
                                     f"{t0.kind}-bit table of dim {dim} needs {data_w}",
                                     file=path, tensor=fqn)
    else:
        if shape[1] < data_w + 4:
            raise ShapeMismatchError(
                f"quantized rows of {shape[1]} bytes hold no scale/bias for the model's "
                f"{t0.kind}-bit table of dim {dim} ({data_w} data bytes): save the "
                "weight_qscale/weight_qbias tensors too, or whole rows", file=path, tensor=fqn)
        data_col = 0 if t0.sb_last else 4
    for t in tables:
        c0 = t.col0 * t.kind // 8
        m.load.append(Target(fqn, t.name, shape, (t.row0, data_col + c0),
                             (t.rows, t.data_bytes), torch.uint8,
                             tensor=byte_view(t, t.data_offset, t.data_bytes)))
        if t.kind not in INT_KINDS:
            continue
        if split:
            suffix = f".{_column_shard(t, keys, qs, path)}" if per_shard else ""
            for key, name, off in ((qs + suffix, "weight_qscale" + suffix, 0),
                                   (qb + suffix, "weight_qbias" + suffix, 2)):
                q = keys.get(key)
                if q is None:
                    raise MissingTensorError(f"{key} is missing: the checkpoint's column shards "
                                             f"of table {t0.name!r} are not this model's",
                                             file=path, tensor=t.prefix + name)
                if q.dtype != torch.float16 or tuple(q.global_shape) != (nrows, 1):
                    raise ShapeMismatchError(f"{key}: {q.dtype} {tuple(q.global_shape)}, "
                                             f"expected torch.float16 ({nrows}, 1)",
                                             file=path, tensor=t.prefix + name)
                m.load.append(Target(t.prefix + name, t.name, (nrows, 1), (t.row0, 0),
                                     (t.rows, 1), torch.float16,
                                     tensor=byte_view(t, t.sb_offset + off, 2, torch.float16)))
                m.keys[t.prefix + name] = key
                m.used.add(key)
        else:
            sb_col = data_w if t0.sb_last else 0
            m.load.append(Target(fqn, t.name, shape, (t.row0, sb_col), (t.rows, 4), torch.uint8,
                                 tensor=byte_view(t, t.sb_offset, 4)))
    m.keys[fqn] = ck


def _column_shard(t: QuantTable, keys: Mapping[str, object], qs: str, path: str) -> int:
    """The index of block ``t``'s column shard among its table's (TorchRec saves a column-wise
    sharded table's scales as ``weight_qscale.<index>``, one per shard, in column order). The
    checkpoint must hold as many as the model's table has shards: a scale belongs to its
    columns, another split would need the rows quantized again."""
    md = getattr(getattr(t.config, "global_metadata", None), "shards_metadata", None)
    if not md:
        raise UnsupportedError(f"{t.fqn}: per-column-shard scales ({qs}.<i>) in the "
                               "checkpoint, and this table is not column-wise sharded")
    cols = sorted({int(s.shard_offsets[1]) for s in md})
    saved = 0
    while f"{qs}.{saved}" in keys:
        saved += 1
    if saved != len(cols) or t.col0 not in cols:
        raise ShapeMismatchError(f"{qs}.<i>: the checkpoint's table is saved in {saved} column "
                                 f"shards, this model's in {len(cols)} (at columns {cols}): "
                                 "quantized rows reload only into the same column split",
                                 file=path, tensor=t.fqn)
    return cols.index(t.col0)


def match_quant(tables: List[QuantTable], keys: Mapping[str, object],
                found: Mapping[str, str], *, path: str) -> QuantMatch:
    """What checkpoint ``keys`` (name -> entry) gives ``tables``; ``found``: model names the
    key matching resolved (table weight fqn -> checkpoint key).

    Raises:
        ShapeMismatchError, DtypeMismatchError: a table's checkpoint tensor does not fit.
        UnsupportedError: a layout metamat cannot view.
    """
    m = QuantMatch()
    by_fqn: Dict[str, List[QuantTable]] = {}
    for t in tables:
        by_fqn.setdefault(t.fqn, []).append(t)
    for fqn, ts in by_fqn.items():
        ck = found.get(fqn)
        if ck is None:
            continue
        e = keys[ck]
        if e.dtype in _FLOATS:
            _float_blocks(ts, fqn, ck, e.global_shape, m, path)
        elif e.dtype == torch.uint8:
            _raw_blocks(ts, fqn, ck, keys, m, path)
        else:
            raise DtypeMismatchError(f"saved dtype {e.dtype}: a quantized table loads from "
                                     "float32/float16/bfloat16 rows (quantized while read) or "
                                     "uint8 (already quantized)", file=path, tensor=fqn)
        m.used.add(ck)
        m.tables.add(fqn)
    return m
