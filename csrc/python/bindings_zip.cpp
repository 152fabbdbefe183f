// Locate the records of many torch.save zip blobs inside one DCP data file.
//
// DCP's TORCH_SAVE format writes every chunk as a whole torch.save archive (a stored zip) in a
// rank's data file: opening a checkpoint of 100,000 chunks parses 100,000 zip directories.
// In Python that cost ~20 µs per chunk (struct calls, dicts, slices); here ~2 µs. Torch-free:
// bytes in, offsets out. The file is read with pread, never mapped (see FileSource). metamat/checkpoint/torch_save.py's `parse_torch_save` (zipfile,
// every check) is the reference: tests compare the two on real and damaged files, and a blob
// this accepts must give the same records.
//
// Accepted (anything else -> None, and the careful parser decides or raises the named error):
// an end record at the very end with no comment, one disk, the central directory right
// before it (or before the zip64 end record and locator torch writes, which must agree),
// stored (uncompressed), unencrypted entries without zip64 sizes or extra fields, unique ASCII
// names, local headers that repeat the name, records that fit in the blob and end before the
// next entry's local header (the directory for the last), exactly one
// "<prefix>/data.pkl", a "<prefix>/byteorder" (if any) that says "little", CRC-32s of both
// matching the directory, sizes within the metadata limit.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <numeric>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

uint16_t u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// zlib's CRC-32 (polynomial 0xEDB88320), one table; the blobs checked are a few hundred bytes.
uint32_t crc32(const uint8_t* p, size_t n) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

struct Entry {
  std::string name;
  uint32_t lho, size, crc;
};

// Python's bytes.strip(): ASCII whitespace at both ends.
bool says_little(const uint8_t* p, size_t n) {
  auto ws = [](uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  size_t a = 0, b = n;
  while (a < b && ws(p[a])) ++a;
  while (b > a && ws(p[b - 1])) --b;
  return b - a == 6 && std::memcmp(p + a, "little", 6) == 0;
}

// Bytes of a buffer in memory (the tests' blobs).
class MemorySource {
 public:
  MemorySource(const uint8_t* buf, uint64_t size) : buf_(buf), size_(size) {}
  uint64_t size() const { return size_; }
  void begin_blob(uint64_t, uint64_t) {}
  // [off, off + n), or nullptr past the end
  const uint8_t* at(uint64_t off, uint64_t n) {
    return off + n < off || off + n > size_ ? nullptr : buf_ + off;
  }

 private:
  const uint8_t* buf_;
  uint64_t size_;
};

// Bytes of an open file, read with pread into buffers of our own. Never a mapping: touching
// a mapped page of a file that shrank since kills the process with SIGBUS, and DCP files are
// rewritten in place by other jobs. A byte the file no longer has (a short read, an I/O
// error) is "not there": the blob is declined and the careful parser names the error.
//
// A blob is read in few syscalls: blobs of at most kWindow bytes through a window of
// kWindow bytes from the first one's start (consecutive small blobs, DCP's many chunks of
// one file, share one read); larger ones as their first and last kEdge bytes (local headers
// and data.pkl are at the start, the records after the tensor data and the directory at the
// end). Anything else a blob asks for (a long directory or pickle) is read exactly, kept
// until the next blob.
class FileSource {
 public:
  static constexpr uint64_t kWindow = 64 << 10, kEdge = 4 << 10;
  FileSource(int fd, uint64_t size) : fd_(fd), size_(size) {}
  uint64_t size() const { return size_; }
  void begin_blob(uint64_t base, uint64_t length) {
    extra_.clear();
    head_.clear(), tail_.clear();
    if (length <= kWindow) {
      if (base < win_lo_ || base + length > win_lo_ + win_.size())
        fill(&win_, &win_lo_, base, std::min(kWindow, size_ - base));
      return;
    }
    fill(&head_, &head_lo_, base, kEdge);
    fill(&tail_, &tail_lo_, base + length - kEdge, kEdge);
  }
  const uint8_t* at(uint64_t off, uint64_t n) {
    if (off + n < off || off + n > size_) return nullptr;
    if (const uint8_t* p = in(win_, win_lo_, off, n)) return p;
    if (const uint8_t* p = in(head_, head_lo_, off, n)) return p;
    if (const uint8_t* p = in(tail_, tail_lo_, off, n)) return p;
    for (auto& e : extra_)
      if (const uint8_t* p = in(e.second, e.first, off, n)) return p;
    extra_.emplace_back();
    auto& e = extra_.back();
    fill(&e.second, &e.first, off, n);
    return e.second.size() == n ? e.second.data() : nullptr;
  }

 private:
  static const uint8_t* in(const std::vector<uint8_t>& b, uint64_t lo, uint64_t off,
                           uint64_t n) {
    return off >= lo && off + n <= lo + b.size() ? b.data() + (off - lo) : nullptr;
  }
  // [off, off + n) into `b` (fewer bytes where the file ends early or a read fails)
  void fill(std::vector<uint8_t>* b, uint64_t* lo, uint64_t off, uint64_t n) {
    b->resize(size_t(n));
    *lo = off;
    uint64_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(fd_, b->data() + got, size_t(std::min<uint64_t>(n - got, 1ull << 30)),
                                off_t(off + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += uint64_t(r);
    }
    b->resize(size_t(got));
  }
  int fd_;
  uint64_t size_;
  std::vector<uint8_t> win_, head_, tail_;
  uint64_t win_lo_ = 0, head_lo_ = 0, tail_lo_ = 0;
  std::deque<std::pair<uint64_t, std::vector<uint8_t>>> extra_;
};

// What a blob holds: data.pkl's bytes and its storage records (key, absolute offset, size),
// in directory order.
struct Blob {
  std::string pkl;
  std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> records;
};

// The blob at [base, base + length) of `src`, or false.
template <class Source>
bool blob_records(Source& src, uint64_t base, uint64_t length, uint64_t max_metadata,
                  Blob* out) {
  const uint64_t end = base + length;
  if (length < 22 || end > src.size() || end < base) return false;
  src.begin_blob(base, length);
  const uint64_t tail = length >= 98 ? 98 : 22;  // the end record, and zip64's before it
  const uint8_t* t = src.at(end - tail, tail);
  if (!t) return false;
  const uint8_t* e = t + tail - 22;
  if (std::memcmp(e, "PK\x05\x06", 4) != 0) return false;
  const uint16_t disk = u16(e + 4), cd_disk = u16(e + 6), n_here = u16(e + 8), n = u16(e + 10);
  const uint16_t comment = u16(e + 20);
  const uint64_t cd_size = u32(e + 12), cd_off = u32(e + 16);
  if (disk || cd_disk || comment || n != n_here || cd_size > max_metadata) return false;
  uint64_t cd_end = length - 22;  // where the directory must end (zipfile's "concat" is 0)
  if (length >= 98 && std::memcmp(e - 20, "PK\x06\x07", 4) == 0) {
    // zip64 locator and end record: zipfile reads the counts from them; they must agree
    const uint8_t* z = e - 20 - 56;
    // ... and sit where the locator says, 44 bytes long after its size field, right after the
    // directory (newer zipfiles check these, e.g. Python 3.12.3's; the careful parser does)
    if (u32(e - 16) != 0 || u32(e - 4) > 1 || std::memcmp(z, "PK\x06\x06", 4) != 0 ||
        u32(e - 12) != length - 98 || u32(e - 8) || u32(z + 4) != 44 || u32(z + 8) ||
        u32(z + 16) || u32(z + 20) || u32(z + 24) != n || u32(z + 28) || u32(z + 32) != n ||
        u32(z + 36) || u32(z + 40) != cd_size || u32(z + 44) || u32(z + 48) != cd_off ||
        u32(z + 52))
      return false;
    cd_end -= 76;
  }
  if (cd_off + cd_size != cd_end) return false;
  const uint8_t* cd = src.at(base + cd_off, cd_size);
  if (!cd) return false;

  std::vector<Entry> entries;
  entries.reserve(n);
  std::unordered_set<std::string> names;
  uint64_t pos = 0;  // in the directory
  for (unsigned i = 0; i < n; ++i) {
    if (pos + 46 > cd_size) return false;
    const uint8_t* c = cd + pos;
    if (std::memcmp(c, "PK\x01\x02", 4) != 0) return false;
    const uint16_t need = u16(c + 6), flags = u16(c + 8), method = u16(c + 10);
    const uint16_t nlen = u16(c + 28), elen = u16(c + 30), clen = u16(c + 32);
    const uint32_t crc = u32(c + 16), csize = u32(c + 20), usize = u32(c + 24), lho = u32(c + 42);
    // zipfile refuses versions above 6.3, encryption (bits 0, 6) and patched data (bit 5)
    if (need > 63 || (flags & 0x61) || method != 0 || csize != usize || elen ||
        usize == 0xFFFFFFFFu || lho == 0xFFFFFFFFu)
      return false;
    if (pos + 46 + nlen > cd_size) return false;
    std::string name(reinterpret_cast<const char*>(c + 46), nlen);
    for (unsigned char ch : name)
      if (ch >= 0x80) return false;  // utf-8 or cp437 by flag: ASCII reads the same
    if (!names.insert(name).second) return false;
    entries.push_back({std::move(name), lho, usize, crc});
    pos += 46ull + nlen + elen + clen;
    if (pos > cd_size) return false;
  }
  if (pos != cd_size) return false;  // zipfile reads entries until the size is used

  // Where an entry's data may run to: the next entry's local header, or the directory for the
  // last. A record that runs past it overlaps another entry (a zip-bomb pattern, which the
  // careful parser and newer zipfiles refuse); entries sharing a header: declined.
  std::vector<uint64_t> starts;
  starts.reserve(entries.size());
  for (const Entry& en : entries) starts.push_back(en.lho);
  std::sort(starts.begin(), starts.end());
  if (std::adjacent_find(starts.begin(), starts.end()) != starts.end()) return false;
  auto room = [&](uint32_t lho) {
    auto next = std::upper_bound(starts.begin(), starts.end(), uint64_t(lho));
    return next == starts.end() ? cd_off : *next;
  };

  // (absolute data offset) of an entry after checking its local header; false if unusual
  auto record = [&](const Entry& en, uint64_t* at) {
    if (uint64_t(en.lho) + 30 > length) return false;
    const uint8_t* l = src.at(base + en.lho, 30);
    if (!l) return false;
    const uint16_t nl = u16(l + 26);
    if (std::memcmp(l, "PK\x03\x04", 4) != 0 || u16(l + 8) != 0 || nl != en.name.size())
      return false;
    const uint64_t start = uint64_t(en.lho) + 30 + nl + u16(l + 28);
    if (start + en.size > length || start + en.size > room(en.lho)) return false;
    const uint8_t* name = src.at(base + en.lho + 30, nl);
    if (!name || std::memcmp(name, en.name.data(), nl) != 0) return false;
    *at = base + start;
    return true;
  };

  const Entry* pkl = nullptr;
  for (const Entry& en : entries) {
    const std::string& s = en.name;
    if (s.size() >= 9 && s.compare(s.size() - 9, 9, "/data.pkl") == 0 &&
        std::count(s.begin(), s.end(), '/') == 1) {
      if (pkl) return false;
      pkl = &en;
    }
  }
  if (!pkl) return false;
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - 8);  // "<archive>/"
  const std::string dprefix = prefix + "data/";
  uint64_t at = 0;
  for (const Entry& en : entries) {
    if (en.name != prefix + "byteorder") continue;
    if (en.size > max_metadata || !record(en, &at)) return false;
    const uint8_t* p = src.at(at, en.size);
    if (!p || crc32(p, en.size) != en.crc || !says_little(p, en.size)) return false;
  }
  if (pkl->size > max_metadata || !record(*pkl, &at)) return false;
  const uint8_t* p = src.at(at, pkl->size);
  if (!p || crc32(p, pkl->size) != pkl->crc) return false;
  out->pkl.assign(reinterpret_cast<const char*>(p), pkl->size);
  out->records.clear();
  for (const Entry& en : entries) {
    const std::string& s = en.name;
    if (s.compare(0, dprefix.size(), dprefix) != 0 || s.size() < dprefix.size() ||
        s.find('/', dprefix.size()) != std::string::npos)
      continue;
    if (!record(en, &at)) return false;
    out->records.emplace_back(s.substr(dprefix.size()), std::make_pair(at, uint64_t(en.size)));
  }
  return true;
}

// Every blob of `src`, visited in file order (consecutive small blobs share reads), without
// the GIL; then the Python results in the callers' order.
template <class Source>
py::list all_blobs(Source& src, const std::vector<uint64_t>& offsets,
                   const std::vector<uint64_t>& lengths, uint64_t max_metadata) {
  if (offsets.size() != lengths.size())
    throw py::value_error("zip_blobs: offsets and lengths differ in length");
  std::vector<Blob> blobs(offsets.size());
  std::vector<char> ok(offsets.size(), 0);
  {
    py::gil_scoped_release nogil;
    std::vector<size_t> order(offsets.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
    for (size_t i : order) ok[i] = blob_records(src, offsets[i], lengths[i], max_metadata, &blobs[i]);
  }
  py::list out(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (!ok[i]) {
      out[i] = py::none();
      continue;
    }
    py::dict records;
    for (const auto& r : blobs[i].records)
      records[py::str(r.first)] = py::make_tuple(r.second.first, r.second.second);
    out[i] = py::make_tuple(py::bytes(blobs[i].pkl), records);
  }
  return out;
}

}  // namespace

void metamat_bind_zip(py::module_& m) {
  m.def(
      "zip_blobs",
      [](py::buffer file, const std::vector<uint64_t>& offsets,
         const std::vector<uint64_t>& lengths, uint64_t max_metadata) {
        py::buffer_info info = file.request();
        MemorySource src(static_cast<const uint8_t*>(info.ptr),
                         uint64_t(info.size) * uint64_t(info.itemsize));
        return all_blobs(src, offsets, lengths, max_metadata);
      },
      py::arg("file"), py::arg("offsets"), py::arg("lengths"), py::arg("max_metadata"),
      "For each torch.save zip blob [offset, offset+length) of the bytes `file`: (data.pkl "
      "bytes, {storage key: (data offset, size)}) with absolute offsets, or None where the "
      "blob is not a plain stored archive with matching CRCs (or a directory or metadata "
      "record is larger than `max_metadata`).");
  m.def(
      "zip_blobs_fd",
      [](int fd, uint64_t size, const std::vector<uint64_t>& offsets,
         const std::vector<uint64_t>& lengths, uint64_t max_metadata) {
        if (fd < 0) throw py::value_error("zip_blobs_fd: fd must be an open file descriptor");
        FileSource src(fd, size);
        return all_blobs(src, offsets, lengths, max_metadata);
      },
      py::arg("fd"), py::arg("size"), py::arg("offsets"), py::arg("lengths"),
      py::arg("max_metadata"),
      "zip_blobs over the first `size` bytes of the open file `fd`, read with pread (never "
      "mapped: a file that shrinks meanwhile declines its blobs, None, instead of SIGBUS).");
}
