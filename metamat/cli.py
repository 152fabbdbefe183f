"""``python -m metamat``: look into checkpoints and plans without loading anything.

    python -m metamat inspect CKPT [--json]
    python -m metamat plan CKPT --world-size N --sharding row_wise [--rank R] [--json]
    python -m metamat checksum CKPT [--block-bytes N] [--out FILE] [--json]  # write the manifest
    python -m metamat checksum CKPT --verify [--json]            # check the files against it

``plan`` plans every rank of a world of up to 1,024 ranks and prints one line per rank up to
32 of them; a larger world prints ranks 0-7, the last 8 and the totals (over all ranks when
all were planned); above 1,024 ranks it plans only those 16 (``--rank R`` plans any one).
``--world-size`` is at most 1,048,576 (``METAMAT_MAX_WORLD_SIZE`` raises it).

CKPT may be an ``s3://`` URL; ``checksum`` of one writes the manifest to a local ``--out``
(metamat does not write into the store: upload it as the checkpoint's sidecar).

``--trust-pickles``: the checkpoint's pickles (DCP ``.metadata``, torch.save ``data.pkl``) may
name classes outside metamat's allow-list and run them (plain ``pickle``); only for a
checkpoint you trust.

Exit codes: 0 ok, 2 bad usage, 1 bad checkpoint (the CheckpointError message is printed;
for ``checksum --verify`` also a missing manifest or bytes that differ from it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Dict, List, Optional

import torch

from .checkpoint import CheckpointError, open_checkpoint
from .checkpoint.base import Checkpoint, TensorEntry, itemsize, numel
from .blocks import row_blocks, view_shape
from .checkpoint.view import CheckpointView
from .load import plan_reads
from .plan import Target

SHARDINGS = ("table_wise", "row_wise", "column_wise", "data_parallel")
#: --world-size above this is bad usage (the environment variable raises it)
MAX_WORLD_SIZE = ("world size", "METAMAT_MAX_WORLD_SIZE", 1 << 20)
#: worlds up to this many ranks are planned rank by rank (totals exact); larger ones only at
#: the ranks shown
PLAN_ALL_RANKS = 1024
#: text output lists every rank up to this many, else the first and last SHOW_EDGE
SHOW_ALL_RANKS = 32
SHOW_EDGE = 8


def chunk_layout(e: TensorEntry) -> str:
    """How the saved chunks split the tensor: whole, row-wise, column-wise or grid."""
    n = len(e.chunks)
    if n == 1 and tuple(e.chunks[0].sizes) == tuple(e.global_shape):
        return "whole"
    if len(e.global_shape) >= 2:
        full_cols = all(c.sizes[1] == e.global_shape[1] for c in e.chunks)
        full_rows = all(c.sizes[0] == e.global_shape[0] for c in e.chunks)
        if full_cols:
            return f"row-wise x{n}"
        if full_rows:
            return f"column-wise x{n}"
        return f"grid x{n}"
    return f"split x{n}"


def writer_ranks(ckpt: Checkpoint) -> int | None:
    """Ranks that wrote a DCP checkpoint (from its ``__<rank>_<n>.distcp`` file names)."""
    ranks = {m.group(1) for f in ckpt.files
             if (m := re.match(r"__(\d+)_\d+\.distcp$", os.path.basename(f)))}
    return len(ranks) or None


def inspect_info(ckpt: Checkpoint) -> Dict:
    tensors = {}
    total = 0
    for name, e in sorted(ckpt.tensors().items()):
        nbytes = numel(e.global_shape) * itemsize(e.dtype)
        total += nbytes
        tensors[name] = {
            "shape": list(e.global_shape), "dtype": str(e.dtype).replace("torch.", ""),
            "bytes": nbytes, "layout": chunk_layout(e),
            "chunks": [{"file": os.path.relpath(c.file, ckpt_dir(ckpt)), "byte_offset": c.byte_offset,
                        "nbytes": c.nbytes, "offsets": list(c.offsets), "sizes": list(c.sizes)}
                       for c in e.chunks],
        }
    return {"format": ckpt.format, "files": len(ckpt.files), "writer_ranks": writer_ranks(ckpt),
            "total_bytes": total, "tensors": tensors}


def ckpt_dir(ckpt: Checkpoint) -> str:
    return os.path.commonpath([os.path.dirname(f) for f in ckpt.files]) if ckpt.files else "."


def _split(n: int, world: int, rank: int):
    step = -(-n // world)
    lo = min(n, rank * step)
    return lo, max(0, min(n, (rank + 1) * step) - lo)


def rank_targets(ckpt: Checkpoint, world: int, rank: int, sharding: str) -> List[Target]:
    """The blocks ``rank`` would hold if every tensor were sharded ``sharding`` over ``world``
    (row-wise splits dim 0, column-wise the last dim; 0-D tensors are replicated; tensors
    above 2-D are planned as row blocks of their ``(rows, cols)`` view, as materialize does).
    """
    out = []
    for i, (name, e) in enumerate(sorted(ckpt.tensors().items())):
        shape = tuple(e.global_shape)
        off, local = [0] * len(shape), list(shape)
        if sharding == "table_wise" and i % world != rank:
            continue
        if shape and (sharding == "row_wise" or (sharding == "column_wise" and len(shape) == 1)):
            off[0], local[0] = _split(shape[0], world, rank)
        elif shape and sharding == "column_wise":
            off[-1], local[-1] = _split(shape[-1], world, rank)
        if 0 in local:
            continue
        if len(shape) <= 2:
            out.append(Target(fqn=name, key=name, global_shape=shape, offsets=tuple(off),
                              local_shape=tuple(local), dtype=e.dtype))
            continue
        for b in row_blocks(shape, off, local):
            out.append(Target(fqn=name, key=name, global_shape=view_shape(shape),
                              offsets=(b.row, b.col), local_shape=(b.rows, b.cols),
                              dtype=e.dtype))
    return out


def planned_ranks(world: int) -> List[int]:
    """The ranks ``plan`` plans: all of a world of up to ``PLAN_ALL_RANKS``, else the first
    and last ``SHOW_EDGE``."""
    if world <= PLAN_ALL_RANKS:
        return list(range(world))
    return list(range(SHOW_EDGE)) + list(range(world - SHOW_EDGE, world))


def plan_info(ckpt: Checkpoint, world: int, sharding: str, ranks: List[int]) -> Dict:
    """What each of ``ranks`` would read; ``totals`` sums over them, and says whether they are
    the whole world (``all_ranks``)."""
    names = ckpt.tensors()
    view = CheckpointView(ckpt, {n: n for n in names},
                          {n: e.global_shape for n, e in names.items() if len(e.global_shape) > 2})
    per_rank = {}
    for r in ranks:
        p = plan_reads(rank_targets(ckpt, world, r, sharding), view, check_destinations=False)
        planned = sum(op.src_bytes for op in p.ops)
        files = sorted({os.path.basename(p.files[op.file_index]) for op in p.ops})
        per_rank[r] = {"tensors": len({t.fqn for t in p.targets}), "bytes_needed": p.bytes_needed,
                       "bytes_planned": planned, "ops": len(p.ops), "files": files,
                       "read_amplification": planned / p.bytes_needed if p.bytes_needed else 1.0}
    needed = sum(x["bytes_needed"] for x in per_rank.values())
    planned = sum(x["bytes_planned"] for x in per_rank.values())
    totals = {"ranks": len(per_rank), "all_ranks": len(per_rank) == world,
              "bytes_needed": needed, "bytes_planned": planned,
              "ops": sum(x["ops"] for x in per_rank.values()),
              "read_amplification": planned / needed if needed else 1.0}
    return {"format": ckpt.format, "world_size": world, "sharding": sharding, "ranks": per_rank,
            "totals": totals}


def _print_inspect(info: Dict) -> None:
    wr = f", written by {info['writer_ranks']} rank(s)" if info["writer_ranks"] else ""
    print(f"format {info['format']}, {info['files']} file(s){wr}, "
          f"{info['total_bytes'] / 1e9:.3f} GB in {len(info['tensors'])} tensors")
    print(f"{'tensor':<48}{'shape':>20}{'dtype':>10}{'MB':>10}  layout")
    for name, t in info["tensors"].items():
        print(f"{name:<48}{str(tuple(t['shape'])):>20}{t['dtype']:>10}{t['bytes'] / 1e6:>10.2f}  {t['layout']}")


def _print_plan(info: Dict) -> None:
    world = info["world_size"]
    print(f"{info['format']} -> {info['sharding']} over {world} rank(s)")
    print(f"{'rank':>7}{'tensors':>9}{'MB needed':>12}{'MB read':>10}{'ampl.':>7}{'ops':>7}  files")
    ranks = list(info["ranks"].items())
    gap = len(ranks) > SHOW_ALL_RANKS or 1 < len(ranks) < world  # too many, or a sample
    shown = ranks[:SHOW_EDGE] + [None] + ranks[-SHOW_EDGE:] if gap else ranks
    for item in shown:
        if item is None:
            why = "in the totals" if len(ranks) == world else "not planned"
            print(f"{'...':>7}  {world - 2 * SHOW_EDGE} rank(s) not shown ({why}; --rank R "
                  "plans one)")
            continue
        r, x = item  # 7 digits: the largest world allowed by default has 1,048,576 ranks
        print(f"{r:>7}{x['tensors']:>9}{x['bytes_needed'] / 1e6:>12.2f}{x['bytes_planned'] / 1e6:>10.2f}"
              f"{x['read_amplification']:>7.3f}{x['ops']:>7}  {', '.join(x['files'])}")
    t = info["totals"]
    if len(ranks) > 1:
        over = (f"all {world} ranks" if t["all_ranks"] else
                f"the {t['ranks']} ranks shown (above {PLAN_ALL_RANKS} ranks, no others are "
                "planned)")
        print(f"total over {over}: {t['bytes_needed'] / 1e6:.2f} MB needed, "
              f"{t['bytes_planned'] / 1e6:.2f} MB read, amplification "
              f"{t['read_amplification']:.3f}, {t['ops']} ops")


def checksum_info(path: str, block_bytes: int, verify: bool,
                  trust_pickles: bool = False, out: Optional[str] = None) -> Dict:
    """Write (to ``out``, default the sidecar; or, ``verify``, check) the checksum manifest
    of ``path`` (``trust_pickles``: as :func:`metamat.open_checkpoint`'s).

    Raises:
        CheckpointError: the checkpoint does not open; ``verify``: no manifest
            (MissingFileError naming it), or bytes differ (ChecksumMismatchError).
    """
    from .checkpoint.checksum import (build_manifest, read_manifest, save_manifest,
                                      sidecar_path, verify_manifest)

    if verify:
        m = read_manifest(path)
        t = time.perf_counter()
        hashed = verify_manifest(m).bytes_hashed
        secs = time.perf_counter() - t
        side = sidecar_path(path)
    else:
        with open_checkpoint(path, trust_pickles=trust_pickles) as ckpt:
            t = time.perf_counter()  # hashing and writing, not parsing the metadata
            m = build_manifest(ckpt, block_bytes)
            side = save_manifest(m, out or sidecar_path(ckpt.path))
            secs = time.perf_counter() - t
        hashed = sum(c.nbytes for c in m.chunks)
    return {"manifest": side, "verified" if verify else "written": True,
            "chunks": len(m.chunks), "files": len(m.files), "block_bytes": m.block_bytes,
            "bytes_hashed": hashed, "seconds": secs,
            "gbps": hashed / secs / 1e9 if secs > 0 else 0.0}


def _print_checksum(info: Dict) -> None:
    what = "verified" if info.get("verified") else "wrote"
    print(f"{what} {info['manifest']}: {info['chunks']} chunk(s) in {info['files']} file(s), "
          f"{info['bytes_hashed'] / 1e6:.1f} MB hashed in {info['seconds']:.3f} s "
          f"({info['gbps']:.2f} GB/s), {info['block_bytes']} B blocks")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m metamat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    trust = dict(action="store_true",
                 help="unpickle the checkpoint's pickles with plain pickle, which runs any "
                      "class they name (only for a checkpoint you trust)")
    pi = sub.add_parser("inspect", help="format, tensors, chunk layout, total size")
    pi.add_argument("ckpt")
    pi.add_argument("--json", action="store_true")
    pi.add_argument("--trust-pickles", **trust)
    pp = sub.add_parser("plan", help="what each rank would read for a target plan")
    pp.add_argument("ckpt")
    pp.add_argument("--world-size", type=int, required=True,
                    help=f"ranks, at most {MAX_WORLD_SIZE[2]:,} ({MAX_WORLD_SIZE[1]} raises it)")
    pp.add_argument("--sharding", choices=SHARDINGS, default="row_wise")
    pp.add_argument("--rank", type=int, default=None, help="one rank (default: all)")
    pp.add_argument("--json", action="store_true")
    pp.add_argument("--trust-pickles", **trust)
    pc = sub.add_parser("checksum", help="write (or --verify) the xxh3 checksum sidecar")
    pc.add_argument("ckpt")
    pc.add_argument("--block-bytes", type=int, default=None,
                    help="bytes per digest (default 4 MiB; writing only)")
    pc.add_argument("--out", default=None,
                    help="where to write the manifest (default: the checkpoint's sidecar; "
                         "required for an s3:// checkpoint)")
    pc.add_argument("--verify", action="store_true",
                    help="check the files against an existing manifest instead of writing one")
    pc.add_argument("--json", action="store_true")
    pc.add_argument("--trust-pickles", **trust)
    a = p.parse_args(argv)
    if a.cmd == "checksum":
        from .checkpoint.checksum import DEFAULT_BLOCK_BYTES
        if a.ckpt.startswith("s3://") and not a.verify and not a.out:
            print("metamat: checksum does not write into S3: give --out FILE (a local path) "
                  "and upload FILE as the checkpoint's sidecar; --verify checks an s3:// "
                  "checkpoint against it", file=sys.stderr)
            return 2
        if a.verify and a.out:
            p.error("--out applies when writing a manifest, not with --verify")
        if a.out and a.out.startswith("s3://"):
            p.error("--out must be a local path (metamat does not write into S3)")
        if a.verify and a.block_bytes is not None:
            p.error("--block-bytes applies when writing a manifest, not with --verify")
        if a.block_bytes is not None and a.block_bytes <= 0:
            p.error("--block-bytes must be positive")
        try:
            info = checksum_info(a.ckpt, a.block_bytes or DEFAULT_BLOCK_BYTES, a.verify,
                                 a.trust_pickles, out=a.out)
        except CheckpointError as e:
            from .checkpoint import ChecksumMismatchError, WriteError
            what = ("checksum mismatch" if isinstance(e, ChecksumMismatchError) else
                    "cannot write" if isinstance(e, WriteError) else "bad checkpoint")
            print(f"metamat: {what}: {e}", file=sys.stderr)
            return 1
        except OSError as e:  # a path the parsers do not own (should not happen; never a traceback)
            print(f"metamat: cannot read: {e}", file=sys.stderr)
            return 1
        if a.json:
            print(json.dumps(info, indent=1))
        else:
            _print_checksum(info)
        return 0
    if a.cmd == "plan":
        from .checkpoint.limits import limit
        try:
            most = limit(MAX_WORLD_SIZE)
        except ValueError as e:  # a bad METAMAT_MAX_WORLD_SIZE
            p.error(str(e))
        if not 1 <= a.world_size <= most:
            p.error(f"--world-size must be in [1, {most}] (the {MAX_WORLD_SIZE[0]} limit; "
                    f"raise it with the environment variable {MAX_WORLD_SIZE[1]}=N)")
        if a.rank is not None and not 0 <= a.rank < a.world_size:
            p.error("--rank must be in [0, world-size)")
    try:
        with open_checkpoint(a.ckpt, trust_pickles=a.trust_pickles) as ckpt:
            if a.cmd == "inspect":
                info = inspect_info(ckpt)
                show = _print_inspect
            else:
                ranks = [a.rank] if a.rank is not None else planned_ranks(a.world_size)
                info = plan_info(ckpt, a.world_size, a.sharding, ranks)
                show = _print_plan
    except CheckpointError as e:
        print(f"metamat: bad checkpoint: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # as above
        print(f"metamat: cannot read: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        show(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
