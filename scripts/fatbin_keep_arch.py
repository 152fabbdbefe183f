"""Zero, in place, the device code of every CUDA fatbin entry not built for one architecture.

For carrying fbgemm-gpu to the GPU machine (scripts/gpu_torchrec_stack.sh): its wheel holds
sm_80, sm_90a and sm_100a code for every kernel (2.2 GB of 2.5 GB). An H100 only ever loads the
sm_90a entries, so the others' payloads are zeroed: the headers stay, the files keep their size
and layout, and xz then packs the wheel's contents into ~79 MiB instead of ~465 MB (two
transfers instead of nine). Entry layout as CUDA's fatbinary writes it: a fatbin header (magic
0xBA55ED50, version, header size, size of the entries) followed by entries (kind, header size,
payload size, ..., the SM number at offset 28).

Usage: python3 scripts/fatbin_keep_arch.py SM FILE.so [FILE.so ...]   (SM: 90 for sm_90/90a)
"""
from __future__ import annotations

import mmap
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


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


def keep_arch(path: str, sm: int) -> tuple:
    """Zero the payloads of ``path``'s fatbin entries whose SM is not ``sm``; returns
    (fatbin bytes, entries, entries kept, bytes zeroed)."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        sec = _fatbin_section(m)
        if sec is None:
            return 0, 0, 0, 0
        pos, end = sec
        end += pos
        entries = kept = zeroed = 0
        while pos + 16 <= end:
            magic, _version, header_size, size = struct.unpack_from("<IHHQ", m, pos)
            if magic != FATBIN_MAGIC:
                pos += 8  # padding between fatbins
                continue
            e, stop = pos + header_size, pos + header_size + size
            while e < stop:
                _kind, _, entry_header, payload = struct.unpack_from("<HHIQ", m, e)
                arch, = struct.unpack_from("<I", m, e + 28)
                entries += 1
                if arch == sm:
                    kept += 1
                else:
                    m[e + entry_header: e + entry_header + payload] = bytes(payload)
                    zeroed += payload
                e += entry_header + payload
            pos = stop
        m.flush()
        return sec[1], entries, kept, zeroed


def main(argv) -> int:
    sm, paths = int(argv[1]), argv[2:]
    total = zeroed_all = 0
    for p in paths:
        size, entries, kept, zeroed = keep_arch(p, sm)
        if entries and not kept:
            print(f"{p}: no sm_{sm} entry among {entries}", file=sys.stderr)
            return 1
        total += size
        zeroed_all += zeroed
    print(f"fatbins {total / 2**20:.0f} MiB in {len(paths)} files, "
          f"{zeroed_all / 2**20:.0f} MiB zeroed (kept sm_{sm})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
