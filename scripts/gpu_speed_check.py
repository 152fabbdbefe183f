#!/usr/bin/env python3
"""Before timing anything: every init kernel variant this build has writes, on the GPU, exactly
what the CPU engine writes (fp32/fp16/bf16 x Uniform/Normal/TruncatedNormal/Constant, aligned,
narrow, unaligned and strided blocks and a many-table launch, 1 and 4 tiles per block), and a
staged fp32 -> bf16/fp16 load converted on the device equals the host conversion. Prints one
line per case and FAIL lines; exit status 1 on any mismatch. Part of scripts/gpu_speed.sh.
``--emulate`` (CPU, the tests): the same checks through the kernel's host emulation and the
host copy sink."""
from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metamat  # noqa: E402
from metamat._ext import core  # noqa: E402
from metamat.init import SEGMENT_DTYPE, _pack  # noqa: E402

DISTS = [metamat.Uniform(-1, 1), metamat.Normal(0, 2), metamat.TruncatedNormal(),
         metamat.TruncatedNormal(0, 1, -6, 6), metamat.Constant(7), metamat.Uniform(0, 1e-35)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def blocks(dev):
    """(buffer, view, dist, key, r0, c0) cases: aligned, narrow, unaligned, strided."""
    out = []
    shapes = [(700, 128, 0, 0), (300, 96, 32, 0), (50, 7, 1, 1), (64, 33, 3, 1), (9, 1000, 0, 0),
              (1, 4099, 0, 0)]
    for i, (rows, cols, pad, shift) in enumerate(shapes):
        rows = max(1, rows // 10) if EMULATE else rows  # the emulation is slow
        for dtype in DTYPES:
            for k, d in enumerate(DISTS):
                buf = torch.full((shift + rows * (cols + pad) + 1,), float("nan"), dtype=dtype,
                                 device=dev)
                view = buf[shift:shift + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]
                out.append((buf, view, d, f"k{i}{k}", 13 * i, 5 * k))
    return out


EMULATE = "--emulate" in sys.argv
DEV = "cpu" if EMULATE else "cuda"
TABLES = 300 if EMULATE else 2000


def gpu_fill(items, variant, tiles):
    C = core()
    segs = _pack(items, 3)
    if EMULATE:
        C.fill_cuda_emulated_variant(segs.ctypes.data, len(segs), False, variant, tiles)
        return
    pinned = torch.empty(segs.nbytes, dtype=torch.uint8, pin_memory=True)
    table = pinned.numpy().view(SEGMENT_DTYPE)
    table[:] = segs
    scratch = torch.empty(segs.nbytes, dtype=torch.uint8, device="cuda")
    C.fill_cuda_variant(table.ctypes.data, len(segs), table.ctypes.data, scratch.data_ptr(),
                        torch.cuda.current_stream().cuda_stream, variant, tiles)
    torch.cuda.synchronize()


def bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def main() -> int:
    C = core()
    bad = 0
    built = C.fill_variants_built() or EMULATE
    variants = [v for v in C.fill_variants() if not v["diagnostic"] and (built or v["id"] == 0)]
    cpu = blocks("cpu")
    metamat.fill_many_([(v, d, key, r0, c0) for _, v, d, key, r0, c0 in cpu], seed=3)
    for v in variants:
        for tiles in ((1, 4) if built else (1,)):
            gpu = blocks(DEV)
            gpu_fill([(vw, d, key, r0, c0) for _, vw, d, key, r0, c0 in gpu], v["id"], tiles)
            wrong = [i for i, (a, b) in enumerate(zip(cpu, gpu))
                     if not torch.equal(bits(a[0]), bits(b[0].cpu()))]
            # one launch per dtype x dist of many small tables, too
            many_c = [torch.full((3, 40), float("nan")) for _ in range(TABLES)]
            many_g = [t.clone().to(DEV) for t in many_c]
            metamat.fill_many_([(t, DISTS[i % 4], f"m{i}", i, 0) for i, t in enumerate(many_c)],
                               seed=3)
            gpu_fill([(t, DISTS[i % 4], f"m{i}", i, 0) for i, t in enumerate(many_g)], v["id"],
                     tiles)
            wrong_many = sum(not torch.equal(bits(a), bits(b.cpu()))
                             for a, b in zip(many_c, many_g))
            ok = not wrong and not wrong_many
            bad += not ok
            print(f"{'PASS' if ok else 'FAIL'} variant {v['name']:<12} tiles {tiles}: "
                  f"{len(cpu) - len(wrong)}/{len(cpu)} blocks, "
                  f"{TABLES - wrong_many}/{TABLES} tables")
    # device-side conversion of a staged load equals the host conversion
    from safetensors.torch import save_file
    from metamat.load import load_targets
    from metamat.checkpoint import open_checkpoint
    from metamat.plan import Target
    d = tempfile.mkdtemp()
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(1000, 300, generator=g) * 1e-3, "b": torch.randn(77, 4097, generator=g)}
    sd["a"][0, :8] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 65520.0, 3e38,
                                   -1e-45, 6e-8])
    path = os.path.join(d, "c.safetensors")
    save_file(sd, path)
    for dtype in (torch.bfloat16, torch.float16):
        res = {}
        for mode in ("host", "device"):
            os.environ["METAMAT_CONVERT_ON"] = mode
            tg = []
            for n, t in sd.items():
                dst = torch.full((t.shape[0], t.shape[1] + 3), 7.0, dtype=dtype,
                                 device=DEV)[:, 1:t.shape[1] + 1]
                tg.append(Target(n, n, tuple(t.shape), (0, 0), tuple(t.shape), dtype, tensor=dst))
            with open_checkpoint(path) as ck:
                load_targets(tg, ck, staged=True, io="buffered", staging_bytes=64 << 20)
            if not EMULATE:
                torch.cuda.synchronize()
            res[mode] = [bits(x.tensor).cpu() for x in tg]
        os.environ.pop("METAMAT_CONVERT_ON")
        ok = all(torch.equal(a, b) for a, b in zip(res["host"], res["device"]))
        bad += not ok
        print(f"{'PASS' if ok else 'FAIL'} staged fp32 -> {dtype}: device conversion == host")
    print("check:", "FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
