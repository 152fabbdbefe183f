"""Keep, in place, only the CUDA device code one GPU loads: one architecture's cubins, less
the kernel families a drop pattern names.

For carrying fbgemm-gpu to the GPU machine in one transfer (scripts/gpu_torchrec_stack.sh).
fbgemm-gpu 1.6.0's wheel holds sm_80, sm_90a and sm_100a cubins for every translation unit
(2.2 GB of its 2.4 GB); an H100/H200 only loads the sm_90a ones. Every other entry's payload
is replaced by a valid, empty cubin of the entry's own architecture followed by zeros, so the
file keeps its size and layout (nothing else in the ELF moves), the fatbin stays well formed
(`cuobjdump -lelf` / `-xelf all` read every entry) and xz packs the zeros to nothing.

With ``--drop REGEX``, an sm_<SM> cubin whose kernels (demangled base names, ``EmptyKernel``
left out) ALL match REGEX is replaced the same way and relabelled as an sm_80 entry: that
translation unit then has no code for this GPU, the well-known "no kernel image is available
for execution on the device" case, which the CUDA runtime reports only if one of its kernels
is launched (loading, registration and every other kernel are unaffected). Host code is never
touched: every library loads and registers every operator as before.

Entry layout as CUDA's fatbinary writes it: a fatbin header (magic 0xBA55ED50, version, header
size, size of the entries) followed by entries of a 64-byte header (kind, header size at 4,
payload size at 8, compressed size at 16, SM at 28, flags at 40, uncompressed size at 56) and
a payload (an ELF cubin, zstd-compressed when flags has 0x8000).

Usage: python3 scripts/fatbin_keep_arch.py [--drop REGEX] [--empty-dir DIR] [--report FILE]
                                          SM FILE.so [FILE.so ...]
  SM: 90 for sm_90/90a. --empty-dir: where empty_sm_<N>.cubin files are (made with nvcc when
  missing; without nvcc the payloads are zeroed instead, as before). --report: a TSV of the
  dropped entries (library, entry, kernels).
"""
from __future__ import annotations

import argparse
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

FATBIN_MAGIC = 0xBA55ED50
ELF_KIND = 2
COMPRESSED = 0x2000 | 0x8000  # fatbin flags: compressed payload (LZ4 / zstd)
ARCH_VARIANT = 0x100000 | 0x1000000  # the 'a' / 'f' variants (sm_90a, sm_100a)
DROPPED_AS = 80  # a dropped sm_<SM> entry is relabelled as this architecture
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _fatbin_section(m: mmap.mmap):
    """(offset, size) of the ELF64 file's .nv_fatbin section, or None."""
    shoff, = struct.unpack_from("<Q", m, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", m, 0x3A)

    def header(i):  # name, type, flags, addr, offset, size, ...
        return struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize)

    strings = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        name = m[strings + h[0]: m.find(b"\0", strings + h[0])]
        if name == b".nv_fatbin":
            return h[4], h[5]
    return None


def entries(m: mmap.mmap):
    """(entry offset, kind, header size, payload size, SM, flags) of every fatbin entry."""
    sec = _fatbin_section(m)
    if sec is None:
        return
    pos, end = sec
    end += pos
    while pos + 16 <= end:
        magic, _version, header_size, size = struct.unpack_from("<IHHQ", m, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # padding between fatbins
            continue
        e, stop = pos + header_size, pos + header_size + size
        while e < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", m, e)
            arch, = struct.unpack_from("<I", m, e + 28)
            flags, = struct.unpack_from("<Q", m, e + 40) if entry_header >= 48 else (0,)
            yield e, kind, entry_header, payload, arch, flags
            e += entry_header + payload
        pos = stop


def cubin_kernels(data: bytes) -> list:
    """Mangled names of a cubin's functions (its .text.<name> sections)."""
    if data[:4] != b"\x7fELF":
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    strings = header(shstrndx)[4]
    out = []
    for i in range(shnum):
        n = strings + header(i)[0]
        name = data[n: data.index(b"\0", n)].decode("ascii", "replace")
        if name.startswith(".text."):
            out.append(name[6:])
    return out


def base_names(mangled: list) -> list:
    """Demangled base names (no namespace, template arguments or parameters)."""
    if not mangled:
        return []
    try:
        dem = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True,
                             text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        dem = mangled
    out = []
    for d in dem[:len(mangled)]:
        d = re.sub(r"\(.*", "", d)
        d = re.sub(r"<.*", "", d).replace("void ", "").strip()
        out.append(d.split("::")[-1])
    return out


def _payload(m, e, entry_header, payload, flags) -> bytes:
    data = bytes(m[e + entry_header: e + entry_header + payload])
    if flags & COMPRESSED and data[:4] == ZSTD_MAGIC:
        csize, = struct.unpack_from("<Q", m, e + 16)
        data = subprocess.run(["zstd", "-dcq"], input=data[:csize or payload],
                              capture_output=True, check=True).stdout
    return data


def empty_cubins(directory: str | None, archs) -> dict:
    """{SM: bytes of a valid empty cubin}, made with nvcc when not in ``directory``."""
    out = {}
    nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc")
                                    and "/usr/local/cuda/bin/nvcc")
    with tempfile.TemporaryDirectory() as tmp:
        d = directory or tmp
        os.makedirs(d, exist_ok=True)
        src = os.path.join(d, "empty.cu")
        for sm in sorted(set(archs)):
            path = os.path.join(d, f"empty_sm_{sm}.cubin")
            if not os.path.exists(path) and nvcc:
                if not os.path.exists(src):
                    open(src, "w").close()
                for target in (f"sm_{sm}a", f"sm_{sm}"):
                    r = subprocess.run([nvcc, "-cubin", f"-arch={target}", "-o", path, src],
                                       capture_output=True)
                    if r.returncode == 0:
                        break
            if os.path.exists(path):
                with open(path, "rb") as f:
                    out[sm] = f.read()
    return out


def keep_arch(path: str, sm: int, drop: re.Pattern | None = None,
              empties: dict | None = None, report=None) -> tuple:
    """Keep ``path``'s sm_<sm> cubins (less those ``drop`` names); returns (fatbin bytes,
    entries, entries kept, bytes emptied)."""
    empties = empties or {}
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        sec = _fatbin_section(m)
        if sec is None:
            return 0, 0, 0, 0
        count = kept = emptied = 0
        other_flags = {}
        for e, kind, eh, payload, arch, flags in entries(m):
            if arch != sm:
                other_flags.setdefault(arch, flags & ~COMPRESSED)
        for e, kind, eh, payload, arch, flags in entries(m):
            count += 1
            new_arch = arch
            if arch == sm:
                names = []
                if drop is not None and kind == ELF_KIND:
                    names = [n for n in base_names(cubin_kernels(
                        _payload(m, e, eh, payload, flags))) if n != "EmptyKernel"]
                if not names or not all(drop.search(n) for n in names):
                    kept += 1
                    continue
                new_arch = DROPPED_AS
                if report is not None:
                    report.write(f"{os.path.basename(path)}\t{count - 1}\t"
                                 f"{','.join(sorted(set(names)))}\n")
            blob = empties.get(new_arch, b"")
            if len(blob) > payload or kind != ELF_KIND:
                blob = b""
            m[e + eh: e + eh + payload] = blob + bytes(payload - len(blob))
            emptied += payload
            if blob or new_arch != arch:  # an uncompressed cubin of new_arch now
                new_flags = flags & ~COMPRESSED
                if new_arch != arch:
                    new_flags = other_flags.get(new_arch, (flags & ~(COMPRESSED | ARCH_VARIANT)))
                struct.pack_into("<Q", m, e + 16, 0)
                struct.pack_into("<I", m, e + 28, new_arch)
                struct.pack_into("<Q", m, e + 40, new_flags)
                if eh >= 64:
                    struct.pack_into("<Q", m, e + 56, 0)
        m.flush()
        return sec[1], count, kept, emptied


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drop", help="regex: drop sm_<SM> cubins all of whose kernels match")
    ap.add_argument("--empty-dir", help="folder of empty_sm_<N>.cubin (made with nvcc)")
    ap.add_argument("--report", help="TSV of the dropped entries")
    ap.add_argument("sm", type=int)
    ap.add_argument("paths", nargs="+")
    a = ap.parse_args(argv[1:])
    drop = re.compile(a.drop) if a.drop else None
    archs = {DROPPED_AS}
    for p in a.paths:  # every architecture present gets its empty cubin
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            archs.update(arch for _, _, _, _, arch, _ in entries(m))
    empties = empty_cubins(a.empty_dir, archs)
    if not empties:
        print("no nvcc: other architectures' payloads are zeroed, not emptied", file=sys.stderr)
    total = emptied_all = kept_all = 0
    report = open(a.report, "w") if a.report else None
    try:
        for p in a.paths:
            size, count, kept, emptied = keep_arch(p, a.sm, drop, empties, report)
            if count and not kept and drop is None:
                print(f"{p}: no sm_{a.sm} entry among {count}", file=sys.stderr)
                return 1
            total += size
            emptied_all += emptied
            kept_all += kept
    finally:
        if report:
            report.close()
    print(f"fatbins {total / 2**20:.0f} MiB in {len(a.paths)} files, "
          f"{emptied_all / 2**20:.0f} MiB emptied, {kept_all} sm_{a.sm} cubins kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
