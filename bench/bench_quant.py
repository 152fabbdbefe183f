"""--mode quant: a training checkpoint (float tables, DCP) into a quantized inference model
(TorchRec's quantized EmbeddingBagCollection, INT8 by default), same checkpoint, same run:

* TorchRec's path (the baseline): build the float model on the CPU (``EmbeddingBagCollection
  (device="cpu")``: allocated and initialised), ``dcp.load`` the whole checkpoint into it,
  then ``quantize_embeddings`` (fbgemm's row-wise op per table);
* metamat: the quantized model built on meta (``quantize_embeddings`` of the float model on
  meta: nothing allocated), then ``metamat.materialize(qmodel, ckpt)``: rows read in pieces
  into a bounded scratch buffer and quantized into place by the C++ core;
* metamat refreshing a live quantized model (made before the clock starts) from the same
  checkpoint: the rows quantized into a shadow of each TBE storage, copied in at the end.

All end with the same bytes (checked). Each repetition runs in its own process; the time is
from building the model to the quantized model ready; the peak is the process's VmHWM growth
over its RSS before the model is built (``/proc/self/clear_refs`` resets the high-water mark
after the imports), so it is that method's memory alone. The page cache is warm (the
checkpoint is read once before the runs): both methods read the same cached bytes.

    python bench/bench_quant.py --size-gib 2 --reps 3      # or: bench/materialize.py --mode quant
    python bench/bench_quant.py --device cuda              # into CUDA inference TBEs (a GPU)
    python bench/bench_quant.py --ranks 2                  # quant-sharded row-wise (one process)

With ``--ranks N`` the quantized model is TorchRec's inference sharding of it, every table
row-wise over N ranks of one process (``shard_quant_model``, split scale/bias, CPU): TorchRec's
path adds ``shard_quant_model`` and ``load_state_dict`` of the converted model's state;
metamat's shards the quantized model on meta and materializes it.

With ``--device cuda`` both build the quantized EBC on the GPU (TorchRec: the float EBC on the
GPU, ``dcp.load`` into it, fbgemm's CUDA quantization; metamat: rows quantized on the host and
copied to the device) and the growth of the GPU's peak allocation (torch's allocator) is
reported too; a fourth row runs metamat with ``METAMAT_QUANT_ON=device`` (float rows uploaded,
quantized by fbgemm's CUDA op).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import Row, env_header, finish, print_table, progress, write_csv  # noqa: E402

QDTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4,
           "fp16": torch.float16}
METHODS = ("torchrec: float EBC + dcp.load + quantize_embeddings",
           "metamat.materialize(quantized EBC on meta)",
           "metamat refresh of a live quantized EBC",
           "metamat.materialize, quantized on the device")  # --device cuda only


def _tables(size_bytes: int, n_tables: int, dim: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    rows = max(8, size_bytes // (n_tables * dim * 4))
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                               feature_names=[f"f{i}"]) for i in range(n_tables)]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _digest(qmodel) -> str:
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(qmodel.state_dict().items()):
        blocks = [s.tensor for s in v.local_shards()] if hasattr(v, "local_shards") else [v]
        h.update(k.encode())
        for b in blocks:
            b = b.elem if hasattr(b, "elem") else b
            h.update(b.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _quantize(m, qdtype: str, ranks: int):
    """TorchRec's conversion; for row-wise inference sharding, with split scale/bias (which
    TorchRec's row-wise quant sharding requires)."""
    from torchrec.inference.modules import quantize_embeddings

    if ranks:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.quant.embedding_modules import (
            quant_prep_enable_quant_state_dict_split_scale_bias_for_types as split)

        split(m, [EmbeddingBagCollection])
    return quantize_embeddings(m, dtype=QDTYPES[qdtype], inplace=True)


def _shard(q, ranks: int, device: str):
    """TorchRec's inference sharding of quantized model ``q``, every table row-wise over
    ``ranks`` ranks of this process, on ``device`` ("meta", or "cpu": TorchRec's own)."""
    from torchrec.distributed import global_settings
    from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
    from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.inference.modules import shard_quant_model

    sharder = QuantEmbeddingBagCollectionSharder(
        fused_params={FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True})
    plan = construct_module_sharding_plan(
        q[0], per_param_sharding={n: row_wise(compute_kernel="quant")
                                  for n, _ in q[0].embedding_bags.items()},
        local_size=ranks, world_size=ranks, device_type="cpu", sharder=sharder)
    global_settings.set_propogate_device(True)  # TorchRec's CPU inference sharding needs it
    sharded, _ = shard_quant_model(q, world_size=ranks, compute_device="cpu",
                                   sharding_device=device, sharders=[sharder],
                                   sharding_plan=ShardingPlan({"0": plan}))
    return sharded


def _quantized_bytes(q, cuda: bool) -> int:
    from metamat.models.torchrec.quant import quant_modules
    from metamat.models.torchrec.upstream import quant_tbes

    return sum((t.weights_dev if cuda else t.weights_host).numel()
               for _, m in quant_modules(q, live=True) for t in quant_tbes(m))


def child(method: int, ckpt: str, size: int, n_tables: int, dim: int, qdtype: str,
          threads: int, device: str = "cpu", ranks: int = 0) -> dict:
    """One run in this (fresh) process: JSON-able seconds, peak growth, digest."""
    from _quiet import quiet

    quiet()
    torch.set_num_threads(threads)
    import torch.distributed.checkpoint as dcp
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import metamat

    tables = _tables(size, n_tables, dim)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.zeros(1, device=dev)  # the CUDA context is not the method's
    served = None
    if method == 2:  # a live model to refresh, made before the clock starts
        m = torch.nn.Sequential(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        served = _quantize(m, qdtype, ranks)
        if ranks:
            served = _shard(served, ranks, "meta")
        metamat.materialize(served, device=dev)
    resettable = _reset_peak()
    before = _status("VmRSS:")
    if cuda:  # the GPU's peak growth from here (a refreshed model's own bytes not counted)
        torch.cuda.synchronize(dev)
        device_before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if method == 2:
        q = served
        metamat.materialize(q, ckpt, io_threads=threads, device=dev)
    elif method == 0:
        m = torch.nn.Sequential(EmbeddingBagCollection(tables=tables, device=dev))
        sd = m.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        q = _quantize(m, qdtype, ranks)
        if ranks:  # TorchRec shards in place and keeps no split scales: the state loaded
            converted = q.state_dict()
            q = _shard(q, ranks, device)
            q.load_state_dict(converted)
            del converted
    else:
        # method 3: float rows uploaded, fbgemm's op quantizes them on the GPU
        os.environ["METAMAT_QUANT_ON"] = "device" if method == 3 else "host"
        m = torch.nn.Sequential(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        q = _quantize(m, qdtype, ranks)
        if ranks:
            q = _shard(q, ranks, "meta")
        metamat.materialize(q, ckpt, io_threads=threads, device=dev)
    if cuda:
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM:") if resettable else 0
    qbytes = _quantized_bytes(q, cuda)
    return {"seconds": seconds, "grew": peak - before if resettable else -1,
            "qbytes": qbytes, "digest": _digest(q),
            "device_peak": torch.cuda.max_memory_allocated(dev) - device_before if cuda else 0}


def _gpu_peak(results: dict, method: int) -> float:
    return max(r["device_peak"] for r in results[method])


def _check_digests(results: dict, cuda: bool) -> None:
    """Every method's bytes agree with those of the methods that quantize alike: on the CPU
    all of them; on a GPU metamat's host conversion (materialize, refresh) with itself, and
    fbgemm's CUDA op (TorchRec's conversion on the GPU, METAMAT_QUANT_ON=device) with
    itself (the cuda tests compare the two kinds)."""
    groups = [[1, 2], [0, 3]] if cuda else [[0, 1, 2]]
    for g in groups:
        seen = {i: {r["digest"] for r in results[i]} for i in g if i in results}
        if len(set().union(*seen.values())) != 1:
            raise RuntimeError(
                "quantized bytes differ between methods that quantize alike: "
                + "; ".join(f"{METHODS[i]}: {sorted(d)}" for i, d in seen.items()))


def _write_checkpoint(root: str, size: int, n_tables: int, dim: int) -> str:
    """A float training checkpoint of the tables (DCP, one writer), filled fast."""
    import torch.distributed.checkpoint as dcp
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import metamat

    ebc = EmbeddingBagCollection(tables=_tables(size, n_tables, dim), device=torch.device("meta"))
    metamat.materialize(torch.nn.Sequential(ebc), seed=1)
    path = os.path.join(root, "dcp")
    dcp.save({f"0.{k}": v for k, v in ebc.state_dict().items()}, checkpoint_id=path,
             no_dist=True)
    for name in os.listdir(path):  # page cache warm: both methods read cached bytes
        with open(os.path.join(path, name), "rb") as f:
            while f.read(64 << 20):
                pass
    return path


def run_quant(a, device: torch.device) -> List[Row]:
    size = int(a.size_gib * 2**30)
    threads = max(1, min(16, os.cpu_count() or 1))
    qdtype = getattr(a, "qdtype", "int8")
    root = tempfile.mkdtemp(prefix="metamat_bench_quant_")
    rows: List[Row] = []
    try:
        progress(f"quant: writing a {size / 2**30:.2f} GiB float checkpoint")
        ckpt = _write_checkpoint(root, size, a.tables, a.dim)
        nbytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        ranks = getattr(a, "quant_ranks", 0)  # bench_quant.py's --ranks (materialize.py: 0)
        if ranks and device.type != "cpu":
            raise SystemExit("--ranks: TorchRec's CPU inference sharding only (device cpu)")
        cuda = device.type == "cuda"
        methods = METHODS if cuda else METHODS[:3]
        if ranks:
            methods = (f"torchrec: float EBC + dcp.load + quantize_embeddings + "
                       f"shard_quant_model (RW x{ranks}) + load_state_dict",
                       f"metamat.materialize(quant-sharded EBC (RW x{ranks}) on meta)",
                       f"metamat refresh of a live quant-sharded EBC (RW x{ranks})")
        results = {i: [] for i in range(len(methods))}
        for rep in range(a.reps):  # interleaved: a shared machine drifts
            for i, name in enumerate(methods):
                progress(f"quant: {name} (rep {rep + 1}/{a.reps})")
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child", str(i), "--ckpt",
                     ckpt, "--size", str(size), "--tables", str(a.tables), "--dim", str(a.dim),
                     "--qdtype", qdtype, "--threads", str(threads), "--device", device.type,
                     "--ranks", str(ranks)],
                    capture_output=True, text=True, timeout=3600)
                if out.returncode != 0:
                    raise RuntimeError(f"{name} failed:\n{out.stderr[-4000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results[i].append(r)
                print(f"   {r['seconds']:.3f} s, host peak growth {r['grew'] / 2**30:.3f} GiB"
                      + (f", GPU peak growth {r['device_peak'] / 2**30:.3f} GiB" if cuda else "")
                      + f", digest {r['digest']}", flush=True)  # a stopped run keeps these
        digests = {r["digest"] for rs in results.values() for r in rs}
        _check_digests(results, cuda)
        for i, name in enumerate(methods):
            rs = results[i]
            grew = statistics.median(r["grew"] for r in rs)
            q = rs[0]["qbytes"]
            gpu = (f"; GPU peak growth {max(r['device_peak'] for r in rs) / 2**30:.3f} GiB"
                   if device.type == "cuda" else "")
            rows.append(Row("quant", name, nbytes, statistics.median(r["seconds"] for r in rs),
                            len(rs), peak_rss_gib=grew / 2**30,
                            extra=f"{qdtype} on {device.type}"
                                  + (f", row-wise over {ranks} ranks" if ranks else "")
                                  + f"; quantized {q / 2**30:.3f} GiB; "
                                  f"host peak/quantized {grew / q:.2f}{gpu}; same bytes: "
                                  f"{len(digests) == 1}"))
        finish(rows, methods[0], methods[0])
        print_table(f"quant ({qdtype} on {device.type}"
                    + (f", quant-sharded row-wise over {ranks} ranks" if ranks else "")
                    + f", {a.tables} tables x dim {a.dim}, float checkpoint "
                    f"{nbytes / 2**30:.2f} GiB DCP, page cache warm, {threads} threads; peak = "
                    "VmHWM growth per process)", rows, methods[0], methods[0])
        base, mm = rows[:2]
        print(f"metamat: {base.seconds / mm.seconds:.1f}x faster, peak memory "
              f"{mm.peak_rss_gib / base.peak_rss_gib:.2f}x TorchRec's (host)"
              + (f", {_gpu_peak(results, 1) / _gpu_peak(results, 0):.2f}x (GPU)" if cuda else "")
              + " (goal: >= 5x faster, <= 0.3x memory at INT8)")
        print(f"refresh of a live model: {rows[2].seconds / mm.seconds:.2f}x the time of "
              f"materializing from meta, peak {rows[2].peak_rss_gib / mm.peak_rss_gib:.2f}x "
              "(the shadow of the quantized storages)")
        if len(rows) > 3:
            print(f"quantized on the device: {mm.seconds / rows[3].seconds:.2f}x the host "
                  "quantization's speed (METAMAT_QUANT_ON=device if > 1)")
        if len(digests) != 1:  # each conversion is checked against its own kind above
            print("NOTE: fbgemm's CUDA quantization (TorchRec's conversion on the GPU, "
                  "METAMAT_QUANT_ON=device) and the host conversion differ in bytes")
        if getattr(a, "out", None):
            write_csv(os.path.join(a.out, "results.csv"), rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0, help="float checkpoint bytes")
    p.add_argument("--tables", type=int, default=5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--qdtype", choices=tuple(QDTYPES), default="int8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: into CUDA inference TBEs")
    p.add_argument("--out", default=None, help="directory for results.csv")
    p.add_argument("--ranks", dest="quant_ranks", type=int, default=0,
                   help="quant-shard every table row-wise over this many ranks of one process")
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a.child, a.ckpt, a.size, a.tables, a.dim, a.qdtype, a.threads,
                               a.device, a.quant_ranks)))
        return 0
    if a.quick:
        a.size_gib, a.reps = min(a.size_gib, 1 / 16), min(a.reps, 1)
    from _quiet import quiet

    quiet()
    print(env_header(torch.device(a.device)))
    run_quant(a, torch.device(a.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
