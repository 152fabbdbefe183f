#!/usr/bin/env python3
"""Instructions per output byte of the CUDA init kernel, from its SASS (no GPU needed).

Compiles scripts/sass_probe.cu for one architecture and reads each probe kernel's SASS up to
its first unpredicated EXIT (what a thread executes per work unit; slow paths such as the IEEE
sqrt fix-up sit after it). Prints, per kernel variant and (distribution, dtype):

* the staged store path of an interior unit (32 values: the kernel's common case): instructions,
  instructions per output byte, registers, and the instruction mix by the unit that executes it
  (IMAD.WIDE / IMAD.HI / other IMAD on the FMA-heavy pipe, FP32, integer/logic ALU, conversions,
  MUFU, memory, control);
* where they go, by difference of probes: stores + staging (Constant), Philox (the diagnostic
  probe that stores raw Philox words, less Constant), the transform (the rest);
* the pieces of the transforms, one call each (less an empty probe's count).

Needs nvcc and cuobjdump (CUDA 12.x/13.x; `pip install --target DIR nvidia-cuda-cuobjdump`
gives cuobjdump where the toolkit lacks it: pass --cuobjdump or put it on PATH).

Usage: python3 scripts/sass_kernel_mix.py [--arch 90] [--json out.json] [--cuobjdump PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = {0: "Uniform", 1: "Normal", 2: "TruncNormal", 3: "Constant"}
SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# KernelCfg<math, split, store, bits> -> variant name (csrc/include/metamat/fill_variant.h)
CFGS = {("0", "0", "0", "0"): "base", ("1", "0", "0", "0"): "math",
        ("1", "1", "0", "0"): "split", ("1", "0", "0", "1"): "philoxbits"}
PIECES = ["kNothing", "kPhilox1", "kPhilox1Split", "kUniform", "kUniformFold", "kLog",
          "kLogOpen0", "kSinCos", "kSinCosSel", "kSqrt", "kBoxMuller", "kBoxMullerSel",
          "kErfinv", "kErfinvCentralP", "kPackBf16"]
CLASSES = ["imad_wide", "imad_hi", "imad", "fp32", "alu", "conv", "mufu", "mem", "ctrl", "other"]


def tool(name: str, given: str | None) -> str:
    if given:
        return given
    found = shutil.which(name)
    if found:
        return found
    for d in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]:
        p = Path(d) / "bin" / name
        if d and p.exists():
            return str(p)
    for p in sys.path:  # pip's nvidia-cuda-cuobjdump / nvidia-cuda-nvcc wheels
        for cand in Path(p).glob(f"nvidia/cu1*/bin/{name}"):
            return str(cand)
    sys.exit(f"sass_kernel_mix: {name} not found (PATH, CUDA_HOME, /usr/local/cuda, or "
             f"pip install --target DIR nvidia-cuda-cuobjdump and pass --cuobjdump)")


def classify(op: str) -> str:
    base = op.split(".")[0]
    if op.startswith("IMAD.WIDE"):
        return "imad_wide"
    if op.startswith("IMAD.HI"):
        return "imad_hi"
    if base == "IMAD":
        return "imad"
    if base in ("FADD", "FMUL", "FFMA", "FMNMX") or op.startswith("FMUL"):
        return "fp32"
    if base in ("I2F", "I2FP", "F2I", "F2F", "F2FP", "I2I", "FRND"):
        return "conv"
    if base == "MUFU":
        return "mufu"
    if base in ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "LDC", "ATOM", "RED",
                "LDSM", "ULDC"):
        return "mem"
    if base in ("BRA", "EXIT", "CALL", "RET", "BAR", "WARPSYNC", "NOP", "BSSY", "BSYNC",
                "BMOV", "YIELD", "ELECT", "VOTE", "VOTEU"):
        return "ctrl"
    if base in ("LOP3", "SHF", "IADD3", "VIADD", "ISETP", "FSETP", "FSEL", "SEL", "LEA",
                "PRMT", "MOV", "IABS", "IMNMX", "VIMNMX", "PLOP3", "FLO", "POPC", "S2R", "CS2R",
                "P2R", "R2P", "UMOV", "UIADD3", "ULOP3", "USHF", "ULEA", "UISETP", "USEL",
                "S2UR", "R2UR", "BREV", "FCHK", "UPRMT", "IDP", "HFMA2"):
        return "alu"
    return "other"


def functions(cuobjdump: str, cubin: Path) -> dict:
    """name -> list of opcodes up to the first unpredicated EXIT."""
    out, cur = {}, None
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    done = set()
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m or cur is None or cur in done:
            continue
        op = m.group(2)
        out[cur].append(op)
        if op == "EXIT" and not m.group(1):
            done.add(cur)
    return out


def registers(cuobjdump: str, cubin: Path) -> dict:
    text = subprocess.run([cuobjdump, "-res-usage", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    regs, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1)
        m = re.search(r"REG:(\d+)", line)
        if m and cur:
            regs[cur] = int(m.group(1))
    return regs


def mix(ops) -> dict:
    c = Counter(classify(o) for o in ops)
    return {k: c.get(k, 0) for k in CLASSES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--nvcc")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--keep", help="keep the cubin here")
    a = ap.parse_args()
    nvcc, cuobjdump = tool("nvcc", a.nvcc), tool("cuobjdump", a.cuobjdump)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(a.keep or tmp) / "sass_probe.cubin"
        subprocess.run([nvcc, "-std=c++17", "-O3", "--fmad=false", f"-arch=sm_{a.arch}",
                        "-cubin", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}",
                        "-o", str(cubin),
                        str(ROOT / "scripts/sass_probe.cu")], check=True)
        funcs, regs = functions(cuobjdump, cubin), registers(cuobjdump, cubin)
    staged, pieces = {}, {}
    for name, ops in funcs.items():
        m = re.search(r"staged_probeINS_9KernelCfgILb(\d)ELi(\d)ELi(\d)ELb(\d)EEELNS_8DistKindE(\d)"
                      r"ENS_\d+(\w+?)EEEv", name)
        if m:
            cfg = CFGS.get(m.groups()[:4], "+".join(m.groups()[:4]))
            kind, dtype = KINDS[int(m.group(5))], m.group(6)
            staged[(cfg, kind, dtype)] = {"instr": len(ops), "regs": regs.get(name),
                                          "bytes": 32 * SIZES[dtype], "mix": mix(ops),
                                          "ops": Counter(ops)}
            continue
        m = re.search(r"fn_probeILi(\d+)EEEv", name)
        if m:
            pieces[PIECES[int(m.group(1))]] = {"instr": len(ops), "mix": mix(ops)}
    empty = pieces.get("kNothing", {"instr": 0})["instr"]
    print(f"# CUDA init kernel, sm_{a.arch}: per interior work unit (32 values), staged store path")
    print("# instr = SASS instructions one thread runs per unit (static, up to EXIT); /B = per "
          "output byte")
    print(f"{'variant':<11} {'dist':<12} {'dtype':<5} {'instr':>6} {'/B':>6} {'regs':>4}  "
          + " ".join(f"{c:>9}" for c in CLASSES))
    rows = []
    order = list(CFGS.values())

    def rank(kv):
        (cfg, kind, dtype), _ = kv
        return (order.index(cfg) if cfg in order else 9, dtype, kind)

    for (cfg, kind, dtype), r in sorted(staged.items(), key=rank):
        print(f"{cfg:<11} {kind:<12} {dtype:<5} {r['instr']:>6} {r['instr'] / r['bytes']:>6.2f} "
              f"{r['regs'] or 0:>4}  " + " ".join(f"{r['mix'][c]:>9}" for c in CLASSES))
        rows.append({"variant": cfg, "dist": kind, "dtype": dtype, "instr": r["instr"],
                     "bytes": r["bytes"], "instr_per_byte": r["instr"] / r["bytes"],
                     "regs": r["regs"], "mix": r["mix"]})
    print("\n# where a unit's instructions go (differences of probes): stores+staging = Constant; "
          "Philox = philoxbits - Constant; transform = the rest")
    split = []
    for dtype in ("F32", "BF16"):
        const = staged.get(("base", "Constant", dtype), {}).get("instr")
        bitsn = staged.get(("philoxbits", "Uniform", dtype), {}).get("instr")
        if const is None or bitsn is None:
            continue
        for cfg in ("base", "math", "split"):
            for kind in ("Uniform", "Normal", "TruncNormal"):
                r = staged.get((cfg, kind, dtype))
                if not r:
                    continue
                philox = bitsn - const
                d = {"variant": cfg, "dist": kind, "dtype": dtype, "stores": const,
                     "philox": philox, "transform": r["instr"] - bitsn, "total": r["instr"]}
                split.append(d)
                print(f"{cfg:<11} {kind:<12} {dtype:<5} stores+staging {const:>4}  Philox "
                      f"{philox:>4}  transform {d['transform']:>5}  = {r['instr']:>5}  "
                      f"(IMAD.WIDE {r['mix']['imad_wide']}, IMAD.HI {r['mix']['imad_hi']})")
    print(f"\n# transform pieces, one call (probe less the empty probe's {empty} instructions)")
    for p in PIECES[1:]:
        if p in pieces:
            print(f"{p[1:]:<14} {pieces[p]['instr'] - empty:>5}   "
                  + " ".join(f"{c}={v}" for c, v in pieces[p]["mix"].items() if v))
    # stores: the op names of the base fp32/bf16 Uniform staged probes
    for dtype in ("F32", "BF16"):
        r = staged.get(("base", "Uniform", dtype))
        if r:
            st = {k: v for k, v in r["ops"].items() if k.startswith(("STG", "STS", "LDS"))}
            print(f"# memory ops of a {dtype} Uniform unit (base): {st}")
    if a.json:
        Path(a.json).write_text(json.dumps({"arch": a.arch, "staged": rows, "split": split,
                                            "pieces": {k: {"instr": v["instr"] - empty,
                                                           "mix": v["mix"]}
                                                       for k, v in pieces.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
