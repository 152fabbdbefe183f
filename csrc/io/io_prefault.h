// Batched page faults for destinations about to be overwritten: madvise(MADV_POPULATE_WRITE)
// (Linux 5.14) maps a whole range in one call, cheaper than one trap per 4 KiB page (measured
// on this project's VM: 2 GiB memset 1.8-1.9 s, populate + memset 1.1-1.5 s). Torch-free and
// fill-free: the reader (io_piece.cpp) and the fill engine (fill_cpu_prefault.h) share it.
//
// Safety: only whole pages inside the given bytes are populated; population never writes a
// byte (it maps the same zero, file or copied-on-write contents the writer's own fault would);
// any error just leaves the faults to the writer (an EINVAL from a kernel without
// MADV_POPULATE_WRITE is probed once per process). METAMAT_PREFAULT=0 turns it off.
#pragma once
#include <cstdint>

namespace metamat {

// True unless METAMAT_PREFAULT=0 or the kernel lacks MADV_POPULATE_WRITE.
bool prefault_enabled();

uintptr_t prefault_page_size();

// True when the page at `p` is already mapped (a filled or pre-touched buffer): the range is
// then most likely resident, and populating it would only walk its page tables again.
bool page_mapped(uintptr_t p);

// Populates the whole pages inside bytes [p, p + n) that a writer is about to overwrite
// completely, when prefaulting is enabled, there are at least a few of them and the first is
// not mapped yet.
void prefault_bytes(void* p, int64_t n);

}  // namespace metamat
