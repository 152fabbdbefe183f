"""--mode load --storage s3: rank-local loads from an S3-compatible store (moto on loopback).

    python bench/materialize.py --mode load --storage s3 [--size-gib 0.25] [--ranks 2]

A DCP checkpoint of ``--tables`` fp32 tables (``--size-gib`` in all, default capped at 0.25 GiB
here: moto keeps objects in memory and serves them from Python) is written locally by
``torch.distributed.checkpoint`` and uploaded. Then, for each plan (table-wise, row-wise,
column-wise over ``--ranks`` ranks; the ranks run one after another in this process, so each
rank's time is its own):

* metamat: ``open_checkpoint(s3://...)`` + ``load_targets`` (coalesced concurrent ranged GETs);
  reported: bytes requested / bytes needed, GB/s of needed bytes;
* ``dcp.load`` through fsspec (``FsspecReader``, s3fs) of the same rank's tensors: DCP reads
  every saved chunk that overlaps the rank's shard whole (here: each needed tensor), so this
  is what a DCP user's rank pays for the same shard; skipped when s3fs is not installed;
* the ceiling: one single-stream GET of the whole data object (obstore, same server), GB/s;
* ``metamat row_wise verified``: the row-wise loads with ``verify`` (the checksum sidecar
  written before upload): the cost of hashing every block the GETs touch.

moto runs in its own process. Plain moto re-reads the whole object under a per-key lock on
every GET (a ranged GET costs O(object), concurrent GETs of one object are serialised), which
is unlike any real store; the bench therefore patches moto (in its process) to keep each
object's bytes, so ranges cost O(range). ``METAMAT_BENCH_MOTO_PLAIN=1`` measures plain moto.

Goals: requested / needed <= 1.05 for table-wise and row-wise; >= 3x dcp.load (fsspec) on
resharding (row-wise and column-wise plans of a checkpoint saved by one rank).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _common import Row, print_table, timeit  # noqa: E402

CPU = torch.device("cpu")  # the timed calls read into host memory


def run_s3(a, device: torch.device) -> List[Row]:
    import obstore
    from _s3server import S3Server, upload_dir

    import torch.distributed.checkpoint as dcp
    from metamat.checkpoint import open_checkpoint
    from metamat.checkpoint.checksum import write_manifest
    from metamat.cli import rank_targets
    from metamat.load.remote import RemoteStats, execute_plan_remote
    from metamat.load.plan import plan_load
    from metamat.load.verify import load_manifest

    size = int((a.size_gib if a.size_gib < 2.0 else 0.25) * 2**30)
    reps = max(1, min(a.reps, 3))
    a.moto_plain = os.environ.get("METAMAT_BENCH_MOTO_PLAIN") == "1"
    world = a.ranks
    rows_per = max(1, size // (a.tables * a.dim * 4))
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(rows_per, a.dim, generator=g) for i in range(a.tables)}
    total = sum(t.numel() * 4 for t in sd.values())
    tmp = tempfile.mkdtemp(prefix="metamat_s3_")
    srv = S3Server(process=True, fast_ranges=not a.moto_plain)
    out: List[Row] = []
    try:
        dcp.save(sd, checkpoint_id=os.path.join(tmp, "ckpt"))
        write_manifest(os.path.join(tmp, "ckpt"))  # uploaded with it: the verified row
        url = upload_dir(srv, os.path.join(tmp, "ckpt"), "bench/ckpt")
        opts = srv.options(direct=True)
        ck = open_checkpoint(url, storage_options=opts)
        data = [f for f in ck.files]
        print(f"\n[s3] moto at {srv.direct_url}; DCP {total / 2**20:.0f} MiB in "
              f"{len(data)} object(s), {a.tables} tables x {rows_per} x {a.dim} fp32; "
              f"{world} ranks run one after another; median of {reps}")

        def whole():
            for f in data:
                key = f[len(f"s3://{srv.bucket}/"):]
                obstore.get(srv.store, key).bytes()
        obj_bytes = sum(ck.file_sizes[f] for f in data)
        t_whole = timeit(whole, reps, CPU)
        out.append(Row("load-s3", "single-stream GET (whole object)", obj_bytes, t_whole, reps,
                       extra="ceiling"))

        fsspec_ok = True
        try:
            import s3fs  # noqa: F401
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        except ImportError:
            fsspec_ok = False
            print("[s3] s3fs not installed: dcp.load (fsspec) baseline skipped")

        for sharding in ("table_wise", "row_wise", "column_wise"):
            per_rank = [rank_targets(ck, world, r, sharding) for r in range(world)]
            needed = sum(t.local_shape[0] * t.local_shape[1] * 4 for ts in per_rank for t in ts)
            st = RemoteStats()

            def meta_load(manifest=None):
                st.requests = st.bytes_requested = 0
                for ts in per_rank:
                    for t in ts:
                        t.tensor = torch.empty(t.local_shape, dtype=t.dtype)
                    plan = plan_load(ts, ck)
                    execute_plan_remote(plan, stats=st, verify=manifest)
            t_m = timeit(meta_load, reps, CPU)
            for r, ts in enumerate(per_rank):  # bit-exact check
                for t in ts:
                    sl = tuple(slice(o, o + n) for o, n in zip(t.offsets, t.local_shape))
                    assert torch.equal(t.tensor, sd[t.fqn][sl]), (sharding, r, t.fqn)
            amp = st.bytes_requested / needed
            out.append(Row("load-s3", f"metamat {sharding}", needed, t_m, reps,
                           extra=f"requested/needed {amp:.3f}, {st.requests} requests"))
            if sharding == "row_wise":
                manifest = load_manifest(ck)
                t_v = timeit(lambda: meta_load(manifest), reps, CPU)
                out.append(Row("load-s3", "metamat row_wise verified", needed, t_v, reps,
                               extra=f"{t_v / t_m:.2f}x the unverified time, "
                                     f"requested/needed {st.bytes_requested / needed:.3f}"))
            if fsspec_ok:
                def dcp_load():
                    for ts in per_rank:
                        names = sorted({t.fqn for t in ts})
                        dst = {n: torch.empty_like(sd[n]) for n in names}
                        dcp.load(dst, storage_reader=FsspecReader(
                            url, key="testing", secret="testing",
                            client_kwargs={"endpoint_url": srv.direct_url,
                                           "region_name": "us-east-1"}))
                t_d = timeit(dcp_load, reps, CPU)
                out.append(Row("load-s3", f"dcp.load fsspec {sharding}", needed, t_d, reps,
                               extra=f"metamat {t_d / t_m:.2f}x faster"))
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for r in out:
        r.gbps = r.nbytes / r.seconds / 1e9
    ceil = out[0].gbps
    for r in out:
        r.pct_of_ceiling = 100 * r.gbps / ceil
        plan = r.method.split()[-1]
        base = next((b for b in out if b.method == f"dcp.load fsspec {plan}"), None)
        if base is not None:
            r.ratio_to_baseline = r.gbps / base.gbps
    print_table("load from S3 (moto, loopback)", out, "dcp.load fsspec (same plan)",
                "single-stream GET (whole object)")
    return out
