"""Cold loads into GPU memory: metamat's staged pipeline against GPUDirect Storage, same bytes,
same run.

GPUDirect Storage is NVIDIA's cuFile: file bytes DMA'd into device memory without a host
bounce buffer where the machine has the ``nvidia-fs`` driver and a supported filesystem, else
(compatibility mode) cuFile's own POSIX reads into its bounce buffers and copies. This bench
reaches it through ``torch.cuda.gds`` (``GdsFile.load_storage`` = ``cuFileRead``), which
PyTorch's CUDA wheels carry with their ``nvidia-cufile`` dependency: nothing to install on a
GPU machine, unlike kvikio (its wheel, libkvikio and cupy).

Rows (GB/s of bytes landed in device memory; median of ``--reps``; every rep of a cold row
runs after the file was evicted from the page cache, ``metamat._pagecache.evict``):

* ``pinned host -> device copy_``: the PCIe ceiling (best of reps, not cold);
* ``O_DIRECT read ceiling, T threads``: plain O_DIRECT preads of the file in ``--chunk-mib``
  requests into host memory, no metamat code (the storage's ceiling);
* ``metamat staged, io=auto`` (and ``io=direct``): ``load_targets`` of every tensor into device
  tensors through the staging ring;
* ``gds cuFile, T threads``: the file's bytes (its 4 KiB-aligned part, header included) in
  ``--chunk-mib`` pieces, one ``cuFileRead`` per piece, T threads; ``registered``: the device
  buffers registered with cuFile first (``gds_register_buffer``). The first rep's bytes are
  compared with the file's.

What decides the ``io=`` choice (docs/PERFORMANCE.md): a GDS row beating the staged row in the
same run, on the same file. The header says whether the ``nvidia-fs`` driver is loaded (true
GDS) or cuFile runs in compatibility mode, and the filesystem of ``--dir``.

    python bench/bench_gds.py --device cuda [--size-gib 1] [--reps 3] [--threads 1,4,8]
        [--chunk-mib 16] [--dir DIR] [--json F]

``--device cpu`` runs the ceiling and metamat rows into host memory (a check of this script on
a machine without a GPU; the GDS rows say why they did not run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metamat._pagecache import evict  # noqa: E402
from metamat.checkpoint import open_checkpoint  # noqa: E402
from metamat.load import default_io_threads, load_targets  # noqa: E402
from metamat.plan import Target  # noqa: E402

from _common import raw_direct, times  # noqa: E402

ALIGN = 4096  # O_DIRECT / cuFile alignment of file offsets and sizes


def gds_status(directory: str, dev: torch.device) -> Dict[str, object]:
    """Whether GDS can run here and in which mode: torch's cuFile support, the ``nvidia-fs``
    driver (without it cuFile runs in compatibility mode), the filesystem under ``directory``."""
    import torch.cuda.gds as gds

    fs = "?"
    try:
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and os.path.realpath(directory).startswith(parts[1]) and \
                        len(parts[1]) > len(best):
                    best, fs = parts[1], parts[2]
    except OSError:
        pass
    out: Dict[str, object] = {"torch_gds": bool(gds.is_available()),
                              "nvidia_fs": os.path.exists("/proc/driver/nvidia-fs"),
                              "filesystem": fs}
    if dev.type != "cuda":
        out["why_not"] = "no CUDA device"
    elif not out["torch_gds"]:
        out["why_not"] = "this torch was built without cuFile (torch.cuda.gds.is_available())"
    out["mode"] = "GDS (nvidia-fs)" if out["nvidia_fs"] else "cuFile compatibility mode"
    return out


def write_checkpoint(directory: str, size_gib: float, tensors: int) -> str:
    """A safetensors file of ``tensors`` fp32 tensors, ``size_gib`` in all."""
    from safetensors.torch import save_file

    cols = 4096
    rows = max(1, int(size_gib * 2**30 / 4 / cols / tensors))
    g = torch.Generator().manual_seed(0)
    path = os.path.join(directory, "m.safetensors")
    save_file({f"t{i}": torch.randn(rows, cols, generator=g) for i in range(tensors)}, path)
    return path


def device_targets(path: str, dev: torch.device) -> List[Target]:
    with open_checkpoint(path) as ck:
        info = {n: ck.tensors()[n] for n in sorted(ck.tensors())}
    out = []
    for n, meta in info.items():
        shape = tuple(meta.global_shape)
        out.append(Target(n, n, shape, (0,) * len(shape), shape, torch.float32,
                          tensor=torch.empty(shape, dtype=torch.float32, device=dev)))
    return out


class GdsReader:
    """The file's first ``nbytes`` (a multiple of 4 KiB) read by cuFile into device buffers of
    ``chunk`` bytes each, ``threads`` ``cuFileRead`` calls in flight."""

    def __init__(self, path: str, nbytes: int, chunk: int, dev: torch.device,
                 register: bool) -> None:
        import torch.cuda.gds as gds

        self.path, self.gds = path, gds
        self.offsets = list(range(0, nbytes, chunk))
        self.bufs = [torch.empty(min(chunk, nbytes - o), dtype=torch.uint8, device=dev)
                     for o in self.offsets]
        self.registered = []
        if register:
            for b in self.bufs:
                gds.gds_register_buffer(b.untyped_storage())
                self.registered.append(b)

    def read(self, threads: int) -> None:
        f = self.gds.GdsFile(self.path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda i: f.load_storage(self.bufs[i].untyped_storage(),
                                                     self.offsets[i]), range(len(self.bufs))))
        finally:
            del f  # deregisters the handle, closes the file

    def matches_file(self) -> bool:
        with open(self.path, "rb") as f:
            for o, b in zip(self.offsets, self.bufs):
                f.seek(o)
                want = torch.frombuffer(bytearray(f.read(b.numel())), dtype=torch.uint8)
                if not torch.equal(b.cpu(), want):
                    return False
        return True

    def close(self) -> None:
        for b in self.registered:
            self.gds.gds_deregister_buffer(b.untyped_storage())
        self.registered = []
        self.bufs = []


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", default="1,4,8", help="GDS and O_DIRECT thread counts")
    p.add_argument("--chunk-mib", type=int, default=16, help="bytes per cuFileRead / pread")
    p.add_argument("--dir", default=os.path.join("build", "bench-gds"),
                   help="where the file goes: a disk (O_DIRECT; tmpfs refuses it)")
    p.add_argument("--json", help="write the header and every row here")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    threads = sorted({int(t) for t in a.threads.split(",")})
    chunk = max(ALIGN, (a.chunk_mib << 20) // ALIGN * ALIGN)
    made = not os.path.exists(a.dir)
    os.makedirs(a.dir, exist_ok=True)
    path = write_checkpoint(a.dir, a.size_gib, a.tensors)
    size = os.path.getsize(path)
    status = gds_status(a.dir, dev)
    print(f"device {dev}; {size / 2**30:.2f} GiB safetensors in {a.dir} ({status['filesystem']}); "
          f"GDS: torch cuFile {status['torch_gds']}, {status['mode']}; reps {a.reps}, "
          f"{a.chunk_mib} MiB requests, {default_io_threads()} reader threads by default",
          flush=True)
    rows: List[dict] = []
    cold = lambda: evict([path], check=False)  # noqa: E731

    def row(name: str, secs: List[float], nbytes: int, **extra) -> None:
        s = statistics.median(secs)
        rec = {"row": name, "seconds": s, "gbps": nbytes / s / 1e9, **extra}
        rows.append(rec)
        print(f"{name:58s} {s:8.3f} s {rec['gbps']:7.2f} GB/s"
              + "".join(f"  {k}={v}" for k, v in extra.items()), flush=True)

    direct_ok = True
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:  # tmpfs and some overlay filesystems
        direct_ok = False
        print(f"O_DIRECT refused on {a.dir} ({e}): no O_DIRECT or GDS rows; pass --dir on a disk")
    if dev.type == "cuda":
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        devb = torch.empty(size, dtype=torch.uint8, device=dev)
        row("pinned host -> device copy_ (PCIe ceiling, best)",
            [min(times(lambda: devb.copy_(host, non_blocking=True), a.reps, dev))], size)
        del host, devb
    aligned = size // ALIGN * ALIGN
    if direct_ok:
        for t in threads:
            row(f"O_DIRECT read ceiling, {t} thread(s), cold", times(
                lambda t=t: raw_direct([path], t, chunk), a.reps, torch.device("cpu"), cold),
                size, threads=t)
    targets = device_targets(path, dev)
    nbytes = sum(t.tensor.numel() * 4 for t in targets)
    with open_checkpoint(path) as ck:
        for io in ("auto", "direct") if direct_ok else ("auto",):
            row(f"metamat staged, io={io}, cold", times(
                lambda io=io: load_targets(targets, ck, staged=dev.type == "cuda", io=io),
                a.reps, dev, cold), nbytes, io=io)
    del targets
    if "why_not" in status or not direct_ok:
        why = status.get("why_not", "O_DIRECT refused")
        rows.append({"row": "gds", "skipped": why})
        print(f"{'gds cuFile':58s} not run: {why}")
    else:
        for register in (False, True):
            try:
                reader = GdsReader(path, aligned, chunk, dev, register)
            except Exception as e:  # noqa: BLE001 - cuFile missing, registration refused
                rows.append({"row": f"gds registered={register}", "error": str(e)[:300]})
                print(f"gds cuFile, registered={register}: {e}")
                continue
            try:
                for i, t in enumerate(threads):
                    secs = times(lambda t=t: reader.read(t), a.reps, dev, cold)
                    extra = {"bytes_ok": reader.matches_file()} if i == 0 else {}
                    row(f"gds cuFile, {t} thread(s), registered={register}, cold", secs,
                        aligned, threads=t, registered=register, **extra)
            except Exception as e:  # noqa: BLE001 - cuFile's errors (driver, filesystem, ...)
                rows.append({"row": f"gds registered={register}", "error": str(e)[:300]})
                print(f"gds cuFile, registered={register}: FAILED {e}")
            finally:
                reader.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"status": status, "size": size, "rows": rows}, f, indent=1)
    os.remove(path)  # only what this run wrote
    if made:
        shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
