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
* ``gds cuFile``: the file's bytes (its 4 KiB-aligned part, header included) in
  ``--chunk-mib`` pieces, one ``cuFileRead`` per piece, one at a time (torch's binding holds
  the GIL: threads would not overlap them); ``registered``: the device buffers registered with
  cuFile first (``gds_register_buffer``). The bytes are compared with the file's.

What decides the ``io=`` choice (docs/PERFORMANCE.md): a GDS row beating the staged row in the
same run, on the same file. The header says whether the ``nvidia-fs`` driver is loaded (true
GDS) or cuFile runs in compatibility mode, and the filesystem of ``--dir``.

    python bench/bench_gds.py --device cuda [--size-gib 0.5] [--reps 2] [--threads 4]
        [--chunk-mib 16] [--dir DIR] [--json F]

Every row is written to ``--json`` as soon as it is measured, a failing row is recorded and
the next goes on, and the file is removed on the way out (SIGTERM from ``timeout`` too).

``--device cpu`` runs the ceiling and metamat rows into host memory (a check of this script on
a machine without a GPU; the GDS rows say why they did not run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metamat._pagecache import evict  # noqa: E402
from metamat.checkpoint import open_checkpoint  # noqa: E402
from metamat.load import default_io_threads, load_targets  # noqa: E402
from metamat.plan import Target  # noqa: E402

from _common import raw_direct, times  # noqa: E402

ALIGN = 4096  # O_DIRECT / cuFile alignment of file offsets and sizes


def torch_has_gds() -> bool:
    """Whether this torch was built with cuFile: ``torch.cuda.gds.is_available()`` where it
    exists (torch >= 2.12); before, torch puts stand-ins that raise in place of the missing
    bindings, named after ``_dummy_fn``."""
    import torch.cuda.gds as gds

    if hasattr(gds, "is_available"):
        return bool(gds.is_available())
    fn = getattr(torch._C, "_gds_register_buffer", None)
    return fn is not None and "_dummy_fn" not in getattr(fn, "__qualname__", "_dummy_fn")


def gds_status(directory: str, dev: torch.device) -> Dict[str, object]:
    """Whether GDS can run here and in which mode: torch's cuFile support, the ``nvidia-fs``
    driver (without it cuFile runs in compatibility mode), the filesystem under ``directory``."""
    fs = "?"
    real = os.path.realpath(directory)
    try:
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (real == parts[1] or real.startswith(
                        parts[1].rstrip("/") + "/")) and len(parts[1]) > len(best):
                    best, fs = parts[1], parts[2]
    except OSError:
        pass
    out: Dict[str, object] = {"torch_gds": torch_has_gds(),
                              "nvidia_fs": os.path.exists("/proc/driver/nvidia-fs"),
                              "filesystem": fs}
    if dev.type != "cuda":
        out["why_not"] = "no CUDA device"
    elif not out["torch_gds"]:
        out["why_not"] = "this torch was built without cuFile (torch.cuda.gds.is_available())"
    out["mode"] = "GDS (nvidia-fs)" if out["nvidia_fs"] else "cuFile compatibility mode"
    return out


def write_checkpoint(path: str, size_gib: float, tensors: int) -> None:
    """A safetensors file of ``tensors`` fp32 tensors, ``size_gib`` in all, at ``path``."""
    from safetensors.torch import save_file

    cols = 4096
    rows = max(1, int(size_gib * 2**30 / 4 / cols / tensors))
    g = torch.Generator().manual_seed(0)
    save_file({f"t{i}": torch.randn(rows, cols, generator=g) for i in range(tensors)}, path)


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
    ``chunk`` bytes each."""

    def __init__(self, path: str, nbytes: int, chunk: int, dev: torch.device,
                 register: bool) -> None:
        import torch.cuda.gds as gds

        self.path, self.gds = path, gds
        self.offsets = list(range(0, nbytes, chunk))
        self.bufs = [torch.empty(min(chunk, nbytes - o), dtype=torch.uint8, device=dev)
                     for o in self.offsets]
        self.registered = []
        if register:
            try:
                for b in self.bufs:
                    gds.gds_register_buffer(b.untyped_storage())
                    self.registered.append(b)
            except BaseException:
                self.close()
                raise

    def read(self) -> None:
        """One ``cuFileRead`` per chunk, in order (torch's binding holds the GIL: threads
        would not overlap them)."""
        f = self.gds.GdsFile(self.path, os.O_RDONLY)
        try:
            for b, o in zip(self.bufs, self.offsets):
                f.load_storage(b.untyped_storage(), o)
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


class Run:
    """The rows so far, written to ``--json`` after each (a step killed by its time limit
    keeps what it measured); a row that raises is recorded as an error and the next goes on."""

    def __init__(self, json_path: Optional[str], status: dict, size: int) -> None:
        self.json_path, self.rows = json_path, []
        self.head = {"status": status, "size": size}
        self.save()

    def save(self) -> None:
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump({**self.head, "rows": self.rows}, f, indent=1)

    def row(self, name: str, measure, nbytes: int, **extra) -> None:
        try:
            secs = measure()
        except Exception as e:  # noqa: BLE001 - cuFile's and the reader's errors, per row
            self.rows.append({"row": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"{name:58s} FAILED: {type(e).__name__}: {e}", flush=True)
        else:
            s = statistics.median(secs)
            rec = {"row": name, "seconds": s, "gbps": nbytes / s / 1e9, **extra}
            self.rows.append(rec)
            print(f"{name:58s} {s:8.3f} s {rec['gbps']:7.2f} GB/s"
                  + "".join(f"  {k}={v}" for k, v in extra.items()), flush=True)
        self.save()


def _stop_on_sigterm() -> None:
    """``timeout`` sends SIGTERM: raise, so that the file is removed on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", default="4", help="O_DIRECT ceiling thread counts")
    p.add_argument("--chunk-mib", type=int, default=16, help="bytes per cuFileRead / pread")
    p.add_argument("--dir", default=os.path.join("build", "bench-gds"),
                   help="where the file goes: a disk (O_DIRECT; tmpfs refuses it)")
    p.add_argument("--json", help="write the header and every row here (after each row)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    threads = sorted({int(t) for t in a.threads.split(",")})
    chunk = max(ALIGN, (a.chunk_mib << 20) // ALIGN * ALIGN)
    made = not os.path.exists(a.dir)
    os.makedirs(a.dir, exist_ok=True)
    # cuFile writes cufile.log into the working directory unless told otherwise
    os.environ.setdefault("CUFILE_LOGFILE_PATH", os.path.join(os.path.abspath(a.dir),
                                                              "cufile.log"))
    _stop_on_sigterm()
    fd, path = tempfile.mkstemp(suffix=".safetensors", dir=a.dir)
    os.close(fd)
    try:
        measure(a, dev, path, threads, chunk)
    finally:
        os.remove(path)  # only what this run wrote
        if made:
            shutil.rmtree(a.dir, ignore_errors=True)
    return 0


def measure(a, dev: torch.device, path: str, threads: List[int], chunk: int) -> None:
    write_checkpoint(path, a.size_gib, a.tensors)
    size = os.path.getsize(path)
    status = gds_status(a.dir, dev)
    print(f"device {dev}; {size / 2**30:.2f} GiB safetensors in {a.dir} ({status['filesystem']}); "
          f"GDS: torch cuFile {status['torch_gds']}, {status['mode']}; reps {a.reps}, "
          f"{a.chunk_mib} MiB requests, {default_io_threads()} reader threads by default",
          flush=True)
    run = Run(a.json, status, size)
    cold = lambda: evict([path], check=False)  # noqa: E731
    direct_ok = True
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:  # tmpfs and some overlay filesystems
        direct_ok = False
        print(f"O_DIRECT refused on {a.dir} ({e}): no O_DIRECT or GDS rows; pass --dir on a disk")
    if dev.type == "cuda":
        def h2d():
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            devb = torch.empty(size, dtype=torch.uint8, device=dev)
            return [min(times(lambda: devb.copy_(host, non_blocking=True), a.reps, dev))]
        run.row("pinned host -> device copy_ (PCIe ceiling, best)", h2d, size)
    aligned = size // ALIGN * ALIGN
    if direct_ok:
        for t in threads:
            run.row(f"O_DIRECT read ceiling, {t} thread(s), cold", lambda t=t: times(
                lambda: raw_direct([path], t, chunk), a.reps, torch.device("cpu"), cold),
                size, threads=t)
    for io in ("auto", "direct") if direct_ok else ("auto",):
        def staged(io=io):
            targets = device_targets(path, dev)
            with open_checkpoint(path) as ck:
                return times(lambda: load_targets(targets, ck, staged=dev.type == "cuda",
                                                  io=io), a.reps, dev, cold)
        run.row(f"metamat staged, io={io}, cold", staged, size, io=io)
    if "why_not" in status or not direct_ok:
        why = status.get("why_not", "O_DIRECT refused")
        run.rows.append({"row": "gds", "skipped": why})
        run.save()
        print(f"{'gds cuFile':58s} not run: {why}")
        return
    for register in (False, True):
        reader = None

        def gds(register=register):
            nonlocal reader
            reader = GdsReader(path, aligned, chunk, dev, register)
            secs = times(reader.read, a.reps, dev, cold)
            extra["bytes_ok"] = reader.matches_file()
            return secs

        extra: dict = {}
        try:  # torch's cuFileRead holds the GIL: one request at a time (no thread rows)
            run.row(f"gds cuFile, registered={register}, cold", gds, aligned,
                    registered=register)
            if run.rows[-1].get("gbps") is not None:
                run.rows[-1].update(extra)
                run.save()
        finally:
            if reader is not None:
                reader.close()


if __name__ == "__main__":
    sys.exit(main())
