// Locate the records of many torch.save zip blobs inside one mapped DCP data file.
//
// DCP's TORCH_SAVE format writes every chunk as a whole torch.save archive (a stored zip) in a
// rank's data file: opening a checkpoint of 100,000 chunks parses 100,000 zip directories.
// In Python that cost ~20 µs per chunk (struct calls, dicts, slices); here ~2 µs. Torch-free:
// bytes in, offsets out. metamat/checkpoint/torch_save.py's `parse_torch_save` (zipfile,
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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_set>
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

// The blob at [base, base + length) of `buf` (`size` bytes): (pkl offset, pkl size, {key:
// (offset, size)}) with absolute offsets, or None.
py::object blob_records(const uint8_t* buf, uint64_t size, uint64_t base, uint64_t length,
                        uint64_t max_metadata) {
  const uint64_t end = base + length;
  if (length < 22 || end > size || end < base) return py::none();
  const uint8_t* e = buf + end - 22;
  if (std::memcmp(e, "PK\x05\x06", 4) != 0) return py::none();
  const uint16_t disk = u16(e + 4), cd_disk = u16(e + 6), n_here = u16(e + 8), n = u16(e + 10);
  const uint16_t comment = u16(e + 20);
  const uint64_t cd_size = u32(e + 12), cd_off = u32(e + 16);
  if (disk || cd_disk || comment || n != n_here || cd_size > max_metadata) return py::none();
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
      return py::none();
    cd_end -= 76;
  }
  if (cd_off + cd_size != cd_end) return py::none();

  std::vector<Entry> entries;
  entries.reserve(n);
  std::unordered_set<std::string> names;
  uint64_t pos = base + cd_off;
  for (unsigned i = 0; i < n; ++i) {
    if (pos + 46 > base + cd_end) return py::none();
    const uint8_t* c = buf + pos;
    if (std::memcmp(c, "PK\x01\x02", 4) != 0) return py::none();
    const uint16_t need = u16(c + 6), flags = u16(c + 8), method = u16(c + 10);
    const uint16_t nlen = u16(c + 28), elen = u16(c + 30), clen = u16(c + 32);
    const uint32_t crc = u32(c + 16), csize = u32(c + 20), usize = u32(c + 24), lho = u32(c + 42);
    // zipfile refuses versions above 6.3, encryption (bits 0, 6) and patched data (bit 5)
    if (need > 63 || (flags & 0x61) || method != 0 || csize != usize || elen ||
        usize == 0xFFFFFFFFu || lho == 0xFFFFFFFFu)
      return py::none();
    if (pos + 46 + nlen > base + cd_end) return py::none();
    std::string name(reinterpret_cast<const char*>(c + 46), nlen);
    for (unsigned char ch : name)
      if (ch >= 0x80) return py::none();  // utf-8 or cp437 by flag: ASCII reads the same
    if (!names.insert(name).second) return py::none();
    entries.push_back({std::move(name), lho, usize, crc});
    pos += 46ull + nlen + elen + clen;
    if (pos > base + cd_end) return py::none();
  }
  if (pos != base + cd_end) return py::none();  // zipfile reads entries until the size is used

  // Where an entry's data may run to: the next entry's local header, or the directory for the
  // last. A record that runs past it overlaps another entry (a zip-bomb pattern, which the
  // careful parser and newer zipfiles refuse); entries sharing a header: declined.
  std::vector<uint64_t> starts;
  starts.reserve(entries.size());
  for (const Entry& en : entries) starts.push_back(en.lho);
  std::sort(starts.begin(), starts.end());
  if (std::adjacent_find(starts.begin(), starts.end()) != starts.end()) return py::none();
  auto room = [&](uint32_t lho) {
    auto next = std::upper_bound(starts.begin(), starts.end(), uint64_t(lho));
    return next == starts.end() ? cd_off : *next;
  };

  // (absolute data offset) of an entry after checking its local header; false if unusual
  auto record = [&](const Entry& en, uint64_t* at) {
    if (uint64_t(en.lho) + 30 > length) return false;
    const uint8_t* l = buf + base + en.lho;
    const uint16_t nl = u16(l + 26);
    if (std::memcmp(l, "PK\x03\x04", 4) != 0 || u16(l + 8) != 0 || nl != en.name.size())
      return false;
    const uint64_t start = uint64_t(en.lho) + 30 + nl + u16(l + 28);
    if (start + en.size > length || start + en.size > room(en.lho) ||
        std::memcmp(l + 30, en.name.data(), nl) != 0)
      return false;
    *at = base + start;
    return true;
  };

  const Entry* pkl = nullptr;
  for (const Entry& en : entries) {
    const std::string& s = en.name;
    if (s.size() >= 9 && s.compare(s.size() - 9, 9, "/data.pkl") == 0 &&
        std::count(s.begin(), s.end(), '/') == 1) {
      if (pkl) return py::none();
      pkl = &en;
    }
  }
  if (!pkl) return py::none();
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - 8);  // "<archive>/"
  const std::string dprefix = prefix + "data/";
  uint64_t at = 0;
  for (const Entry& en : entries) {
    if (en.name != prefix + "byteorder") continue;
    if (en.size > max_metadata || !record(en, &at) || crc32(buf + at, en.size) != en.crc ||
        !says_little(buf + at, en.size))
      return py::none();
  }
  if (pkl->size > max_metadata || !record(*pkl, &at) || crc32(buf + at, pkl->size) != pkl->crc)
    return py::none();
  const uint64_t pkl_at = at;
  py::dict records;
  for (const Entry& en : entries) {
    const std::string& s = en.name;
    if (s.compare(0, dprefix.size(), dprefix) != 0 || s.size() < dprefix.size() ||
        s.find('/', dprefix.size()) != std::string::npos)
      continue;
    if (!record(en, &at)) return py::none();
    records[py::str(s.substr(dprefix.size()))] = py::make_tuple(at, en.size);
  }
  return py::make_tuple(pkl_at, pkl->size, records);
}

}  // namespace

void metamat_bind_zip(py::module_& m) {
  m.def(
      "zip_blobs",
      [](py::buffer file, const std::vector<uint64_t>& offsets,
         const std::vector<uint64_t>& lengths, uint64_t max_metadata) {
        if (offsets.size() != lengths.size())
          throw py::value_error("zip_blobs: offsets and lengths differ in length");
        py::buffer_info info = file.request();
        const auto* buf = static_cast<const uint8_t*>(info.ptr);
        const uint64_t size = uint64_t(info.size) * uint64_t(info.itemsize);
        py::list out(offsets.size());
        for (size_t i = 0; i < offsets.size(); ++i)
          out[i] = blob_records(buf, size, offsets[i], lengths[i], max_metadata);
        return out;
      },
      py::arg("file"), py::arg("offsets"), py::arg("lengths"), py::arg("max_metadata"),
      "For each torch.save zip blob [offset, offset+length) of the bytes `file`: (data.pkl "
      "offset, data.pkl size, {storage key: (data offset, size)}) with absolute offsets, or "
      "None where the blob is not a plain stored archive with matching CRCs (or a directory or "
      "metadata record is larger than `max_metadata`).");
}
