// Verified reads: the task split is one checksum block per task, so one thread hashes a block
// from its first byte to its last, in order (no partial states to combine). See io_reader.h.
#include "io_verify.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>

#include "metamat/xxh3.h"

namespace metamat {
namespace io {

namespace {

bool raw_contiguous(const ReadOp& o) { return o.rows == 1 && o.src_dtype == o.dst_dtype; }
int64_t span_end(const ReadOp& o) { return o.file_offset + (o.rows - 1) * o.src_stride + o.row_bytes; }
bool converting(const ReadOp& o) { return o.src_dtype != o.dst_dtype; }

// How far file position x is into an element of converting op o (0: on a boundary or outside
// every row).
int64_t element_cut(const ReadOp& o, int64_t x) {
  if (!converting(o) || x <= o.file_offset || x >= span_end(o)) return 0;
  const int64_t rel = x - o.file_offset;
  const int64_t within = o.rows > 1 ? rel % o.src_stride : rel;
  if (within >= o.row_bytes) return 0;  // in a gap between rows
  return within % dtype_size(DType(o.src_dtype));
}

// Calls fn(row, x, y) for each non-empty piece [x, y) of file range [a, b) that op o reads.
template <class Fn>
void for_each_piece(const ReadOp& o, int64_t a, int64_t b, Fn&& fn) {
  const int64_t stride = o.rows > 1 ? o.src_stride : 0;
  int64_t r = (a > o.file_offset && stride > 0) ? (a - o.file_offset) / stride : 0;
  for (; r < o.rows; ++r) {
    const int64_t rs = o.file_offset + r * stride;
    if (rs >= b) break;
    const int64_t x = std::max(a, rs), y = std::min(b, rs + o.row_bytes);
    if (x < y) fn(r, rs, x, y);
  }
}

// Copies/converts the bytes of file range [a, b) (at `src`) that op o needs.
void deliver(const ReadOp& o, const unsigned char* src, int64_t a, int64_t b) {
  const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
  const int64_t ssz = s != d ? dtype_size(s) : 1, dsz = s != d ? dtype_size(d) : 1;
  auto* dst0 = reinterpret_cast<unsigned char*>(o.dst);
  for_each_piece(o, a, b, [&](int64_t r, int64_t rs, int64_t x, int64_t y) {
    unsigned char* dst = dst0 + r * o.dst_stride + (x - rs) / ssz * dsz;
    if (s != d) convert(src + (x - a), s, dst, d, (y - x) / ssz);
    else std::memcpy(dst, src + (x - a), size_t(y - x));
  });
}

// Appends the intervals of [a, b) that op o reads.
void needed(const ReadOp& o, int64_t a, int64_t b, std::vector<std::pair<int64_t, int64_t>>* out) {
  for_each_piece(o, a, b, [&](int64_t, int64_t, int64_t x, int64_t y) { out->push_back({x, y}); });
}

// Bytes of [a, b) that at least one op of `bops` reads (their union: ops may overlap).
int64_t needed_union(const ReadOp* ops, const std::vector<int64_t>& bops, int64_t a, int64_t b,
                     std::vector<std::pair<int64_t, int64_t>>* scratch) {
  scratch->clear();
  for (int64_t k : bops) needed(ops[k], a, b, scratch);
  // One op's intervals come sorted and disjoint; several ops' need merging.
  if (bops.size() > 1 && !std::is_sorted(scratch->begin(), scratch->end()))
    std::sort(scratch->begin(), scratch->end());
  int64_t n = 0, reach = a;
  for (const auto& iv : *scratch) {
    const int64_t x = std::max(iv.first, reach);
    if (iv.second > x) {
      n += iv.second - x;
      reach = iv.second;
    }
  }
  return n;
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

std::string plan_verify(FileTable& files, const ReadOp* ops, int64_t n, const VerifyBlock* blocks,
                        int64_t nblocks, VerifyPlan* plan, int64_t* failed_op) {
  *failed_op = -1;
  if (nblocks > 0 && blocks == nullptr) return "bad verify block array";
  auto where = [&](int64_t k) {
    return "verify block " + std::to_string(k) + " (file index " +
           std::to_string(blocks[k].file_index) + ", offset " + std::to_string(blocks[k].offset) +
           ", " + std::to_string(blocks[k].length) + " bytes)";
  };
  for (int64_t k = 0; k < nblocks; ++k) {
    const VerifyBlock& b = blocks[k];
    if (b.file_index < 0 || b.file_index >= files.count())
      return where(k) + ": file index out of range";
    if (b.offset < 0 || b.length < 0 || b.offset > INT64_MAX - b.length)
      return where(k) + ": negative or overflowing range";
    std::string e = files.validate(b.file_index);
    if (!e.empty()) return "file " + files.path(b.file_index) + ", " + where(k) + ": " + e;
    if (b.offset + b.length > files.size(b.file_index))
      return "file " + files.path(b.file_index) + ", " + where(k) + ": past end of file (" +
             std::to_string(files.size(b.file_index)) + " bytes)";
  }
  std::vector<int64_t>& order = plan->order;
  order.resize(size_t(nblocks));
  for (int64_t k = 0; k < nblocks; ++k) order[size_t(k)] = k;
  auto key = [&](int64_t k) { return std::make_pair(blocks[k].file_index, blocks[k].offset); };
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return key(x) < key(y); });
  for (size_t i = 1; i < order.size(); ++i) {
    const VerifyBlock &p = blocks[order[i - 1]], &q = blocks[order[i]];
    if (p.file_index == q.file_index && p.offset + p.length > q.offset)
      return where(order[i - 1]) + " and " + where(order[i]) + " overlap";
  }
  // Each op: the blocks its span overlaps must cover it without a hole, and not cut an element.
  plan->ops_of.assign(size_t(nblocks), {});
  for (int64_t i = 0; i < n; ++i) {
    const ReadOp& o = ops[i];
    if (o.rows == 0 || o.row_bytes == 0) continue;
    const int64_t s = o.file_offset, e = span_end(o);
    auto it = std::upper_bound(order.begin(), order.end(), std::make_pair(o.file_index, s),
                               [&](const std::pair<int64_t, int64_t>& v, int64_t k) {
                                 return v < key(k);
                               });
    if (it != order.begin() && blocks[*(it - 1)].file_index == o.file_index &&
        blocks[*(it - 1)].offset + blocks[*(it - 1)].length > s)
      --it;  // the block holding s
    int64_t covered = s;
    for (; it != order.end() && blocks[*it].file_index == o.file_index &&
           blocks[*it].offset < e; ++it) {
      const VerifyBlock& b = blocks[*it];
      if (b.offset > covered) break;  // a hole
      for (int64_t cut : {b.offset, b.offset + b.length})
        if (element_cut(o, cut) != 0) {
          *failed_op = i;
          return where(*it) + " cuts an element of this converting op at byte " +
                 std::to_string(cut);
        }
      plan->ops_of[size_t(*it)].push_back(i);
      covered = std::max(covered, b.offset + b.length);
    }
    if (covered < e) {
      *failed_op = i;
      return "bytes [" + std::to_string(covered) + ", " + std::to_string(e) +
             ") are not covered by any verify block";
    }
  }
  return {};
}

std::string read_verified_block(OpReader& rd, ReadShared& shared, const ReadOp* ops,
                                const VerifyBlock& b, const std::vector<int64_t>& bops,
                                BlockOutcome* out) {
  Xxh3 h;
  std::vector<std::pair<int64_t, int64_t>> intervals;
  const int64_t fi = b.file_index, end = b.offset + b.length;
  // Pieces small enough to be hashed while in cache (buffered); direct reads want size.
  // (Measured here: 64 KiB-1 MiB pieces within noise of each other; L2 is 512 KiB on Zen 3.)
  const int64_t piece = std::max<int64_t>(16, std::min(rd.piece_bytes(), rd.view_cap() - 64));
  int64_t p = b.offset;
  while (p < end) {
    if (shared.cancel.load(std::memory_order_relaxed)) return {};
    // In place: a raw contiguous op holds p and no other op wants bytes of the piece.
    const ReadOp* in_place = nullptr;
    for (int64_t k : bops)
      if (raw_contiguous(ops[k]) && ops[k].file_offset <= p && p < span_end(ops[k])) {
        in_place = &ops[k];
        break;
      }
    if (in_place != nullptr) {
      const int64_t e = std::min({span_end(*in_place), end, p + piece});
      bool alone = true;
      for (int64_t k : bops)
        if (&ops[k] != in_place && ops[k].file_offset < e && span_end(ops[k]) > p) alone = false;
      if (alone) {
        auto* dst = reinterpret_cast<unsigned char*>(in_place->dst) + (p - in_place->file_offset);
        std::string err = rd.read_to(fi, p, e - p, dst);
        if (!err.empty()) return err;
        h.update(dst, size_t(e - p));
        out->hashed += e - p;
        p = e;
        continue;
      }
    }
    // Through the bounce buffer: up to the next in-place candidate, on an element boundary of
    // every converting op.
    int64_t e = std::min(end, p + piece);
    for (int64_t k : bops)
      if (raw_contiguous(ops[k]) && ops[k].file_offset > p) e = std::min(e, ops[k].file_offset);
    for (int iter = 0;; ++iter) {
      bool moved = false;
      for (int64_t k : bops) {
        const int64_t cut = element_cut(ops[k], e);
        if (cut != 0) {
          e += dtype_size(DType(ops[k].src_dtype)) - cut;
          moved = true;
        }
      }
      if (!moved) break;
      if (iter == 16 || e > end)
        return "converting ops disagree on element boundaries near byte " + std::to_string(e);
    }
    const unsigned char* src = nullptr;
    std::string err = rd.read_view(fi, p, e - p, &src);
    if (!err.empty()) return err;
    h.update(src, size_t(e - p));
    for (int64_t k : bops) deliver(ops[k], src, p, e);
    out->hashed += e - p;
    out->reread += (e - p) - needed_union(ops, bops, p, e, &intervals);
    p = e;
  }
  out->got = h.digest();
  out->mismatch = out->got != b.digest;
  return {};
}

std::string mismatch_message(const std::string& path, const VerifyBlock& b, uint64_t got) {
  return "checksum mismatch: file " + path + ", block at offset " + std::to_string(b.offset) +
         " (" + std::to_string(b.length) + " bytes): expected xxh3_64 " + hex(b.digest) +
         ", got " + hex(got);
}

}  // namespace io
}  // namespace metamat
