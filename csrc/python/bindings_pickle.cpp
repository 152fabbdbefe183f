// Walk the opcodes of a pickle before Python's C unpickler runs it.
//
// metamat/checkpoint/unpickle.py restricts *what* a pickle may name (find_class); this pass
// bounds what its bytes may make the unpickler *allocate* and refuses the opcodes no
// checkpoint needs. CPython's unpickler keeps its memo in an array grown to twice the largest
// index a PUT names: one LONG_BINPUT of 2**28 (a 10-byte pickle) costs 4 GiB of zeroed memory
// and ten seconds. Picklers number memo entries 0, 1, 2, ... so an index is refused when it
// is more than `kMemoSlack` past the number of memo writes before it.
//
// Refused (the message names the opcode and its byte offset): an unknown opcode, a protocol
// above 5, an argument or length that runs past the end, no STOP, a memo index as above,
// extension-registry codes (EXT1/2/4 resolve through copyreg's process-wide cache, past
// find_class), persistent ids unless the format has them (torch.save's storages), and
// out-of-band buffers. Torch-free: bytes in, a message out ("" when the walk is clean).
// pickletools.genops is the reference (tests/test_unpickle.py compares the two).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace {

constexpr uint64_t kMemoSlack = 1024;

uint64_t le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string hex(uint8_t op) {
  static const char* d = "0123456789abcdef";
  return std::string("0x") + d[op >> 4] + d[op & 15];
}

// Why the pickle in [p, p+n) is refused, "" if it is not; *refused: true for what a
// well-formed pickle may hold but metamat will not run (memo index, EXT, PERSID, buffers),
// false for bytes that are not a pickle at all (unknown opcode, truncated).
std::string scan(const uint8_t* p, uint64_t n, bool persistent_ids, bool* refused) {
  *refused = false;
  auto refuse = [&](std::string why) {
    *refused = true;
    return why;
  };
  uint64_t pos = 0, puts = 0;
  auto at = [&](uint64_t where) { return " at byte " + std::to_string(where); };
  while (pos < n) {
    const uint64_t start = pos;
    const uint8_t op = p[pos++];
    const uint64_t left = n - pos;
    auto need = [&](uint64_t k) { return k <= left; };
    auto truncated = [&]() { return "opcode " + hex(op) + at(start) + " runs past the end"; };
    auto line = [&](uint64_t from, uint64_t* end) {  // the '\n' ending a text argument
      const void* nl = std::memchr(p + from, '\n', size_t(n - from));
      if (!nl) return false;
      *end = uint64_t(static_cast<const uint8_t*>(nl) - p);
      return true;
    };
    auto memo = [&](uint64_t idx) -> std::string {
      if (idx > puts + kMemoSlack)
        return refuse("memo index " + std::to_string(idx) + at(start) + " is past the " +
                      std::to_string(puts) + " entries written before it");
      ++puts;
      return "";
    };
    uint64_t e = 0, len = 0;
    switch (op) {
      // no argument
      case '(': case '.': case '0': case '1': case '2': case 'N': case 0x88: case 0x89:
      case '}': case ']': case ')': case 0x8f: case 'a': case 'e': case 'b': case 'd':
      case 'l': case 't': case 0x85: case 0x86: case 0x87: case 's': case 'u': case 0x90:
      case 0x91: case 'R': case 0x81: case 0x92: case 0x93: case 'o':
        if (op == '.') return "";
        break;
      case 0x94:  // MEMOIZE
        ++puts;
        break;
      case 'K': case 'h':  // BININT1, BINGET
        if (!need(1)) return truncated();
        pos += 1;
        break;
      case 'q':  // BINPUT
        if (!need(1)) return truncated();
        if (auto m = memo(p[pos]); !m.empty()) return m;
        pos += 1;
        break;
      case 0x80:  // PROTO
        if (!need(1)) return truncated();
        if (p[pos] > 5) return "unsupported pickle protocol " + std::to_string(p[pos]) + at(start);
        pos += 1;
        break;
      case 'M':  // BININT2
        if (!need(2)) return truncated();
        pos += 2;
        break;
      case 'J': case 'j':  // BININT, LONG_BINGET
        if (!need(4)) return truncated();
        pos += 4;
        break;
      case 'r':  // LONG_BINPUT
        if (!need(4)) return truncated();
        if (auto m = memo(le(p + pos, 4)); !m.empty()) return m;
        pos += 4;
        break;
      case 'G':  // BINFLOAT
        if (!need(8)) return truncated();
        pos += 8;
        break;
      case 0x95:  // FRAME: the opcodes it frames follow inline
        if (!need(8)) return truncated();
        if (le(p + pos, 8) > left - 8) return truncated();
        pos += 8;
        break;
      case 'U': case 0x8c: case 'C': case 0x8a:  // 1-byte length
        if (!need(1)) return truncated();
        len = p[pos];
        if (len > left - 1) return truncated();
        pos += 1 + len;
        break;
      case 'T': case 0x8b:  // BINSTRING, LONG4: signed 4-byte length
        if (!need(4)) return truncated();
        len = le(p + pos, 4);
        if (len & 0x80000000u) return "negative length" + at(start);
        if (len > left - 4) return truncated();
        pos += 4 + len;
        break;
      case 'X': case 'B':  // BINUNICODE, BINBYTES
        if (!need(4)) return truncated();
        len = le(p + pos, 4);
        if (len > left - 4) return truncated();
        pos += 4 + len;
        break;
      case 0x8d: case 0x8e: case 0x96:  // BINUNICODE8, BINBYTES8, BYTEARRAY8
        if (!need(8)) return truncated();
        len = le(p + pos, 8);
        if (len > left - 8) return truncated();
        pos += 8 + len;
        break;
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'g':  // one text line
        if (!line(pos, &e)) return truncated();
        pos = e + 1;
        break;
      case 'p': {  // PUT: a decimal index
        if (!line(pos, &e)) return truncated();
        uint64_t idx = 0;
        if (e == pos || e - pos > 18) return "bad PUT index" + at(start);
        for (uint64_t i = pos; i < e; ++i) {
          if (p[i] < '0' || p[i] > '9') return "bad PUT index" + at(start);
          idx = idx * 10 + (p[i] - '0');
        }
        if (auto m = memo(idx); !m.empty()) return m;
        pos = e + 1;
        break;
      }
      case 'c': case 'i':  // GLOBAL, INST: module and name lines (find_class decides)
        if (!line(pos, &e) || !line(e + 1, &e)) return truncated();
        pos = e + 1;
        break;
      case 'P': case 'Q':  // PERSID, BINPERSID
        if (!persistent_ids) return refuse("persistent id (opcode " + hex(op) + ")" + at(start));
        if (op == 'P') {
          if (!line(pos, &e)) return truncated();
          pos = e + 1;
        }
        break;
      case 0x82: case 0x83: case 0x84:  // EXT1, EXT2, EXT4
        return refuse("extension registry code (opcode " + hex(op) + ")" + at(start));
      case 0x97: case 0x98:  // NEXT_BUFFER, READONLY_BUFFER
        return refuse("out-of-band buffer (opcode " + hex(op) + ")" + at(start));
      default:
        return "unknown opcode " + hex(op) + at(start);
    }
  }
  return "no STOP opcode: the pickle is truncated";
}

}  // namespace

void metamat_bind_pickle(py::module_& m) {
  m.def(
      "pickle_scan",
      [](py::buffer data, bool persistent_ids) {
        py::buffer_info info = data.request();
        const auto* p = static_cast<const uint8_t*>(info.ptr);
        const uint64_t n = uint64_t(info.size) * uint64_t(info.itemsize);
        std::string why;
        bool refused = false;
        {
          py::gil_scoped_release nogil;
          why = scan(p, n, persistent_ids, &refused);
        }
        return py::make_tuple(why, refused);
      },
      py::arg("data"), py::arg("persistent_ids"),
      "Walk the opcodes of the pickle `data` up to its STOP without running it: (why, refused)"
      " with why \"\" if every opcode is known and in bounds and memo indices count up; "
      "refused: the bytes parse but ask for what metamat does not run (see "
      "csrc/python/bindings_pickle.cpp). `persistent_ids`: whether PERSID/BINPERSID may occur.");
}
