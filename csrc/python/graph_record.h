// What the object-graph walk (graph_walk.h) finds, kept in C: every object it recorded and
// every slot (holder, kind, key) referring to one, with the containers that hold them (a
// huge-page allocator, a pointer map). Read by Python through graph.py's views.
#pragma once
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace metamat_py {
namespace graph __attribute__((visibility("hidden"))) {  // as pybind11's own types

namespace py = pybind11;

// The walk's record and maps of a 10k-table model are ~30 MiB, the maps probed at random
// (~2 probes per reference): with 4 KiB pages a probe often missed the TLB as well as the
// cache, and each growth faulted in thousands of fresh pages. Allocations of 2 MiB or more
// ask for transparent huge pages where Linux offers them ("madvise" mode, a common default;
// ~7% of the plan phase at 10k tables, measured in one process against 4 KiB pages).
template <class T>
struct HugeAlloc {
  using value_type = T;
  static constexpr size_t kHuge = size_t(2) << 20;
  HugeAlloc() = default;
  template <class U>
  HugeAlloc(const HugeAlloc<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= kHuge) {
      // mapped 2 MiB larger and trimmed to a 2 MiB-aligned range: a huge page needs one, and
      // kernels before ~6.7 do not align anonymous mappings by themselves
      const size_t size = round(bytes);
      void* p = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      char* const base = static_cast<char*>(p);
      char* const start = base + (kHuge - uintptr_t(base) % kHuge) % kHuge;
      if (start > base) munmap(base, size_t(start - base));
      munmap(start + size, size_t(base + kHuge - start));  // the tail: never empty
      madvise(start, size, MADV_HUGEPAGE);  // a hint: 4 KiB pages if refused
      return reinterpret_cast<T*>(start);
    }
#endif
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (n * sizeof(T) >= kHuge) {
      munmap(p, round(n * sizeof(T)));
      return;
    }
#endif
    std::allocator<T>().deallocate(p, n);
  }
  static size_t round(size_t bytes) { return (bytes + kHuge - 1) / kHuge * kHuge; }
  template <class U>
  bool operator==(const HugeAlloc<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugeAlloc<U>&) const { return false; }
};
template <class T>
using HugeVector = std::vector<T, HugeAlloc<T>>;

// Pointer -> small value, open addressing (linear probing, power-of-two capacity). The walk
// asks it several times per reference; std::unordered_map's node per entry and `div` per
// probe were ~30% of the walk (3k tables, perf).
template <class V>
class PtrMap {
 public:
  // The slot for `key`: `*found` tells whether it was there; a new slot holds V{}. The
  // reference is valid until the next get() on this map (which may grow it).
  V& get(const void* key, bool* found) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    size_t i = index(key);
    while (keys_[i] != nullptr) {
      if (keys_[i] == key) return *found = true, vals_[i];
      i = (i + 1) & (keys_.size() - 1);
    }
    keys_[i] = key, ++size_;
    return *found = false, vals_[i];
  }
  // The value for `key` without inserting it (V{} if absent).
  V peek(const void* key, bool* found) const {
    *found = false;
    if (keys_.empty()) return V{};
    for (size_t i = index(key); keys_[i] != nullptr; i = (i + 1) & (keys_.size() - 1))
      if (keys_[i] == key) return *found = true, vals_[i];
    return V{};
  }
  // Whether `key` is new (and now present).
  bool insert(const void* key) {
    bool found;
    get(key, &found);
    return !found;
  }

 private:
  size_t index(const void* key) const {
    // Fibonacci hashing of the address (objects are 16-byte aligned: the low bits carry none)
    const uint64_t a = uint64_t(uintptr_t(key));
    if (shift_ > 64 - kBlockEntriesLog2) return size_t((a * 0x9E3779B97F4A7C15ull) >> shift_);
    // A big map: each 64 KiB block of memory starts at a Fibonacci-hashed entry and keeps its
    // address order from there. The walk meets objects of one kind in the order they were
    // made, mostly rising addresses, so successive probes hit neighbouring entries, where a
    // fully hashed address cost a cache miss per probe (~10% of a walk of 10k tables).
    const size_t start = size_t(((a >> 16) * 0x9E3779B97F4A7C15ull) >> shift_);
    return (start + size_t(a >> 4)) & (keys_.size() - 1);
  }
  // 4096 entries of 16 bytes: one 64 KiB block. Smaller maps (the per-type caches) hash every
  // address bit: there, keys of one block 1 KiB apart would share an entry.
  static constexpr int kBlockEntriesLog2 = 12;
  void grow() {
    HugeVector<const void*> keys(keys_.empty() ? 64 : 2 * keys_.size(), nullptr);
    HugeVector<V> vals(keys.size());
    keys.swap(keys_), vals.swap(vals_);
    shift_ = 64;
    for (size_t n = keys_.size(); n > 1; n >>= 1) --shift_;
    for (size_t j = 0; j < keys.size(); ++j) {
      if (keys[j] == nullptr) continue;
      size_t i = index(keys[j]);
      while (keys_[i] != nullptr) i = (i + 1) & (keys_.size() - 1);
      keys_[i] = keys[j], vals_[i] = vals[j];
    }
  }
  HugeVector<const void*> keys_;
  HugeVector<V> vals_;
  size_t size_ = 0;
  int shift_ = 64;
};

// Every object the walk recorded (roots first, then in the order first reached) and every
// slot: (holder, kind, key) references to it, in the order found. Holds strong references,
// and is not tracked by Python's collector: a Graph must not be stored where its model can
// reach it (a cycle through the record would never be freed; materialize keeps graphs in
// locals only, tests/test_graph_scan.py checks a materialized model is freed).
struct GraphRecord {
  struct Object {
    PyObject* obj;
    uint32_t first = kNone, last = kNone;  // its slots: a list through Slot::next
  };
  struct Slot {
    PyObject* holder;
    PyObject* key;
    uint32_t next;
    uint8_t kind;  // a Kind: index into `kinds`
  };
  static constexpr uint32_t kNone = 0xffffffffu;
  enum Kind : uint8_t { kAttr, kSlot, kItem, kDictKey, kTuple };  // `kinds`' order

  HugeVector<Object> objects;
  HugeVector<Slot> slots;
  PtrMap<uint32_t> index;  // object -> 1 + its position in `objects`
  size_t with_slots = 0;   // objects with at least one slot
  py::object slot_type;    // graph.Slot
  py::str kinds[5] = {py::str("attr"), py::str("slot"), py::str("item"), py::str("dictkey"),
                      py::str("tuple")};

  GraphRecord() = default;
  GraphRecord(const GraphRecord&) = delete;
  GraphRecord& operator=(const GraphRecord&) = delete;
  ~GraphRecord() {
    for (const Object& o : objects) Py_DECREF(o.obj);
    for (const Slot& sl : slots) Py_DECREF(sl.holder), Py_XDECREF(sl.key);
  }

  // Position of `obj`, recorded now if new (`*added`).
  uint32_t add(PyObject* obj, bool* added) {
    if (objects.size() >= kNone - 1) throw std::length_error("scan_graph: too many objects");
    if (objects.size() == objects.capacity()) objects.reserve(2 * objects.size() + 64);
    bool found;
    uint32_t& at = index.get(obj, &found);
    *added = !found;
    if (found) return at - 1;
    at = uint32_t(objects.size()) + 1;  // before any other get() on `index`
    Py_INCREF(obj);  // no throw from here: the push below has its room
    objects.push_back(Object{obj});
    return uint32_t(objects.size()) - 1;
  }
  void add_slot(uint32_t at, PyObject* holder, Kind kind, PyObject* key) {
    if (slots.size() >= kNone - 1) throw std::length_error("scan_graph: too many references");
    if (slots.size() == slots.capacity()) slots.reserve(2 * slots.size() + 64);
    Py_INCREF(holder), Py_XINCREF(key);  // no throw from here
    const uint32_t i = uint32_t(slots.size());
    slots.push_back(Slot{holder, key, kNone, kind});
    Object& o = objects[at];
    if (o.last == kNone) o.first = i, ++with_slots;
    else slots[o.last].next = i;
    o.last = i;
  }
  // Position of the object whose id is `id`, or kNone (an int no pointer has included).
  uint32_t find(py::handle id) const {
    void* p = PyLong_AsVoidPtr(id.ptr());
    if (!p && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
      PyErr_Clear();
      return kNone;
    }
    bool found;
    const uint32_t at = index.peek(p, &found);
    return found ? at - 1 : kNone;
  }
  py::object make_slot(const Slot& sl) const {
    py::object out = py::reinterpret_steal<py::object>(
        ((PyTypeObject*)slot_type.ptr())->tp_alloc((PyTypeObject*)slot_type.ptr(), 3));
    if (!out) throw py::error_already_set();
    PyObject* items[3] = {sl.holder, kinds[sl.kind].ptr(), sl.key ? sl.key : Py_None};
    for (int i = 0; i < 3; ++i) Py_INCREF(items[i]), PyTuple_SET_ITEM(out.ptr(), i, items[i]);
    return out;
  }
  py::list slots_of(uint32_t at) const {
    py::list out;
    if (at == kNone) return out;
    for (uint32_t i = objects[at].first; i != kNone; i = slots[i].next)
      if (PyList_Append(out.ptr(), make_slot(slots[i]).ptr()) < 0) throw py::error_already_set();
    return out;
  }
};

}  // namespace graph
}  // namespace metamat_py
