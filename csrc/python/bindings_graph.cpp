// The object-graph walk of metamat/models/torchrec/graph.py (`scan`), in C: a sharded model
// holds ~95 objects and ~140 references per embedding table, and the Python loop over them
// cost ~0.5 ms per table. Shard metadata (kind 3) is searched for devices only, containers of
// leaves and shared constants (enums, layouts, process groups: graph._LEAF_TYPES) are not
// recorded: ~32 objects and ~43 slots per table are. The hook registries of modules and
// optimizers (graph._HOOK_ATTRS, ~13 per table) are skipped by name, unread. Torch-free:
// tensors are recognised by the type objects Python passes in. The Python `scan_reference` is
// the specification; tests compare the two on real models.
//
// What the walk finds is kept here, in a GraphRecord, not in Python dicts: an `id` key cost a
// new int, two dict inserts (often a resize) and a list per object, and a Slot tuple per
// reference, ~30% of the walk's instructions (callgrind) and more of its time (allocation and
// cache misses: scan of 3,000 tables 40-44 -> 22-24 us per table). The record keeps each object
// and each slot's holder and key alive, and builds Slot lists only when asked (graph.py's
// read-only views `Graph.objects` and `Graph.slots`).
//
// Visit order and slot order are Python's (an object's first slot is where it was first
// reached): a queue of objects, breadth-first, each object's references in the order
// `_children` yields them (dict: a tensor key's "dictkey" before its "item"; then attributes
// of __dict__, then __slots__ names); metadata is searched depth-first when reached. Objects
// of the `later` types (TorchRec's sharded modules) wait in a second queue, each walked when
// the first runs empty, so one sharded module's objects are walked before the next one's.
// Breadth-first, because TorchRec makes a sharded module's objects kind by kind (10,000
// ShardedTensors, then their metadata, ...): visiting them level by level reads memory in
// roughly the order it was written, where depth-first jumped between ~50 kinds per table. One
// module at a time, because each module's objects were made together: breadth-first across 320
// small modules walked 1.26x slower than depth-first. (Against depth-first, 10k tables in one
// module: walk 0.84x, plan phase 0.90x; 320 modules: walk 0.97x, plan 1.03x. See
// docs/PERFORMANCE.md, stop 37.)
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

namespace py = pybind11;

namespace {

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

struct Walk {
  GraphRecord* rec;      // what is found: objects and their slots
  PyObject* tensors;     // list of tensors reached, in scan order
  PyObject* kinds;       // dict: type -> 0/1/2 (graph._KIND)
  PyObject* kind_of;     // graph._kind_of(obj) for a type not in `kinds`
  PyObject* slot_names;  // graph.slot_names(obj) -> tuple of str
  PyObject* tensor;      // torch.Tensor
  PyObject* device;      // torch.device
  PyObject* device_refs; // list of (holder, key): attributes holding a torch.device or "meta"
  PyObject* hook_owners; // graph._HOOK_OWNERS: types whose hook registries are not walked
  PyObject* hook_attrs;  // graph._HOOK_ATTRS: the names of those registries (a frozenset)
  PyObject* metadata_skip;  // graph._METADATA_SKIP: metadata type -> fields not searched
  PyObject* later_types;  // graph._walked_later(): types whose objects wait in `later`
  std::vector<PyObject*> queue;  // borrowed: every object in it is in `rec` (roots too)
  std::vector<PyObject*> later;  // borrowed, as `queue`: objects of `later_types`
  py::dict names_of;     // type -> slot names (cache of slot_names)
  using Kind = GraphRecord::Kind;
  static constexpr Kind kAttr = GraphRecord::kAttr, kSlot = GraphRecord::kSlot,
                        kItem = GraphRecord::kItem, kDictKey = GraphRecord::kDictKey,
                        kTuple = GraphRecord::kTuple;
  py::str s_dict{"__dict__"}, s_meta{"meta"};

  PtrMap<char> tensor_types;  // isinstance(x, torch.Tensor) by type
  PtrMap<char> dict_types;    // has_dict, by type
  PtrMap<char> kind_cache;    // 1 + kind, by type (see kind())

  // The per-type facts above (and whether it is a set), asked ~230 times per table of a
  // sharded model for a few dozen types: a direct-mapped cache in front of the maps (a probe
  // of a map and its growth check cost more than the rest of kind()). A slot another type
  // takes is refilled from the maps (`hooks`, which has none, is asked again). -1: not known
  // yet.
  struct TypeFacts {
    PyTypeObject* type = nullptr;
    int8_t kind = -1, tensor = -1, dict = -1, set = -1, hooks = -1, later = -1;
  };
  TypeFacts facts[256];
  TypeFacts& facts_of(PyTypeObject* type) {
    TypeFacts& f = facts[(uint64_t(uintptr_t(type)) * 0x9E3779B97F4A7C15ull) >> 56];
    if (f.type != type) {
      hold(types_held, (PyObject*)type);  // facts of a type freed mid-walk: another's
      f = TypeFacts{type};
    }
    return f;
  }
  PtrMap<char> searched;      // metadata objects (and their containers) searched
  std::vector<PyObject*> held;  // snapshots of dict items (strong references, stack-wise)

  // Objects the walk keeps alive until it ends: the types whose facts it caches (the maps
  // and `facts` are keyed by address, and the Python a walk may run can free a type and make
  // another at its address), and the metadata objects `searched` names (likewise). A walk
  // may call back into Python (kind_of, a __dict__ or slot descriptor, a subclass's items()
  // or __iter__): it holds a strong reference to everything it reads after such a call.
  PtrMap<char> types_held_set;
  struct Held {
    std::vector<PyObject*> objs;
    ~Held() {
      for (PyObject* o : objs) Py_DECREF(o);
    }
  } types_held, searched_held;
  void hold(Held& h, PyObject* o) {
    if (&h == &types_held && !types_held_set.insert(o)) return;
    if (h.objs.size() == h.objs.capacity())  // no throw between the incref and the push
      h.objs.reserve(2 * h.objs.size() + 64);
    Py_INCREF(o);
    h.objs.push_back(o);
  }

  bool is_container(PyObject* o) {
    return PyDict_Check(o) || PyList_Check(o) || PyTuple_Check(o) || is_set(o);
  }
  // PyAnySet_Check, decided once per type (for any other type it walks the MRO twice)
  bool is_set(PyObject* o) {
    TypeFacts& f = facts_of(Py_TYPE(o));
    if (f.set < 0) f.set = PyAnySet_Check(o) ? 1 : 0;
    return f.set;
  }
  // graph._holds_nothing: a container whose every element (and key) is a leaf.
  bool holds_nothing(PyObject* o) {
    if (PyDict_Check(o)) {
      // kind() may run Python (kind_of: isinstance reads a `__class__` that can be a
      // property) that empties the dict and frees its items: read a snapshot, as
      // graph._holds_nothing does (list(container.items()))
      bool leaves = true;
      for_items(o, [&](PyObject* k, PyObject* v) {
        if (leaves && (kind(k) || kind(v))) leaves = false;
      });
      return leaves;
    }
    if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {  // read in place, no copy
      // (kind() may run Python for a new type: the list's size is read again each step
      // and the item held meanwhile)
      for (Py_ssize_t i = 0; i < Py_SIZE(o); ++i) {
        py::object item = py::reinterpret_borrow<py::object>(
            PyTuple_CheckExact(o) ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i));
        if (kind(item.ptr())) return false;
      }
      return true;
    }
    py::object seq = py::reinterpret_steal<py::object>(PySequence_Tuple(o));
    if (!seq) throw py::error_already_set();
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(seq.ptr()); i < n; ++i)
      if (kind(PyTuple_GET_ITEM(seq.ptr(), i))) return false;
    return true;
  }

  // isinstance(o, torch.Tensor), decided once per type (~200 ns per call in Python: the
  // tensor metaclass); the walk's objects keep their types alive.
  bool is_tensor(PyObject* o) {
    const int8_t fact = facts_of(Py_TYPE(o)).tensor;
    if (fact >= 0) return fact;
    const bool r = is_tensor_slow(o);
    facts_of(Py_TYPE(o)).tensor = r;  // again: the slow path may run Python
    return r;
  }
  bool is_tensor_slow(PyObject* o) {
    bool found;
    char& known = tensor_types.get(Py_TYPE(o), &found);
    if (!found) known = subtype(Py_TYPE(o), tensor);
    return known;
  }
  // Whether `type` is `cls` (a type) or a subclass of one of `cls` (a tuple of types): the
  // MRO only. isinstance would also ask the object's `__class__`, which may be a property
  // that runs code or claims to be torch.Tensor (graph.py's `_is`).
  static bool subtype(PyTypeObject* type, PyObject* cls) {
    if (PyTuple_Check(cls)) {
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(cls); ++i)
        if (subtype(type, PyTuple_GET_ITEM(cls, i))) return true;
      return false;
    }
    return PyType_Check(cls) && PyType_IsSubtype(type, (PyTypeObject*)cls);
  }

  // isinstance(o, hook_owners) by type (see subtype), decided once per type
  bool owns_hooks(PyObject* o) {
    TypeFacts& f = facts_of(Py_TYPE(o));
    if (f.hooks < 0) f.hooks = subtype(Py_TYPE(o), hook_owners);
    return f.hooks;
  }
  // isinstance(o, later_types) by type, decided once per type
  bool walked_later(PyObject* o) {
    TypeFacts& f = facts_of(Py_TYPE(o));
    if (f.later < 0) f.later = subtype(Py_TYPE(o), later_types);
    return f.later;
  }
  // The fields of a metadata object's type that hold no device (offsets, sizes, a worker's
  // rank...): left unread by the search, or None (a frozenset, held: the visits may run
  // Python that changes graph._METADATA_SKIP).
  py::object skipped_fields(PyObject* obj) {
    PyObject* s = PyDict_GetItemWithError(metadata_skip, (PyObject*)Py_TYPE(obj));
    if (!s && PyErr_Occurred()) throw py::error_already_set();
    return py::reinterpret_borrow<py::object>(s ? s : Py_None);
  }
  bool contains(PyObject* set, PyObject* key) {
    const int r = PySet_Contains(set, key);
    if (r < 0) throw py::error_already_set();
    return r != 0;
  }
  bool is_hook_attr(PyObject* name) { return contains(hook_attrs, name); }

  // A torch.device, or the str "meta" (TorchRec keeps some devices as strings).
  bool is_device_value(PyObject* v) {
    if (Py_TYPE(v) == (PyTypeObject*)device) return true;
    return PyUnicode_CheckExact(v) && PyUnicode_Compare(v, s_meta.ptr()) == 0;
  }

  // graph._KIND of the child's type: asked once per reference (~150 per table), so kept
  // here too (1 + kind; 0: not asked yet). A type's kind never changes.
  int kind(PyObject* child) {
    const int8_t fact = facts_of(Py_TYPE(child)).kind;
    if (fact >= 0) return fact;
    const int r = kind_slow(child);
    facts_of(Py_TYPE(child)).kind = int8_t(r);  // again: kind_of may have run Python
    return r;
  }
  int kind_slow(PyObject* child) {
    bool found;
    char& cached = kind_cache.get(Py_TYPE(child), &found);
    if (found && cached) return cached - 1;
    int r;
    PyObject* k = PyDict_GetItemWithError(kinds, (PyObject*)Py_TYPE(child));  // borrowed
    if (k) {
      r = int(PyLong_AsLong(k));
    } else {
      if (PyErr_Occurred()) throw py::error_already_set();
      py::object v = py::reinterpret_steal<py::object>(PyObject_CallOneArg(kind_of, child));
      if (!v) throw py::error_already_set();
      r = int(PyLong_AsLong(v.ptr()));
    }
    kind_cache.get(Py_TYPE(child), &found) = char(1 + r);  // looked up again, as in is_tensor
    return r;
  }

  // One reference: holder -(kind, key)-> child. `in_metadata`: holder is shard metadata (or a
  // container inside it), searched for device attributes only.
  void visit(PyObject* holder, Kind ref, PyObject* key, PyObject* child, bool in_metadata) {
    const int k = kind(child);
    if (!k) {
      if (ref == kAttr && is_device_value(child)) {
        py::tuple ref = py::make_tuple(py::handle(holder), py::handle(key));
        if (PyList_Append(device_refs, ref.ptr()) < 0) throw py::error_already_set();
      }
      return;
    }
    if (k == 3 || (in_metadata && k == 1 && is_container(child))) {
      // now, not recorded. An exact list or tuple of leaves (shard offsets and sizes: ~8 per
      // table) is not searched item by item: its items are leaves, and a container's
      // references are never "attr" ones, the only kind that records a device. (A subclass
      // may yield other items than it stores: searched as the Python walk does.)
      const bool plain_leaves = k == 1 && (PyList_CheckExact(child) || PyTuple_CheckExact(child))
          && holds_nothing(child);
      if (searched.insert(child)) {
        hold(searched_held, child);  // its address stays its own until the walk ends
        if (!plain_leaves) children(child, true);
      }
      return;
    }
    if (k == 1 && is_container(child) && holds_nothing(child)) return;  // not recorded
    bool added;
    const uint32_t at = rec->add(child, &added);
    rec->add_slot(at, holder, ref, key);
    if (!added) return;
    if (k == 2) {
      if (PyList_Append(tensors, child) < 0) throw py::error_already_set();
      return;
    }
    if (is_tensor(child) && PyList_Append(tensors, child) < 0) throw py::error_already_set();
    (walked_later(child) ? later : queue).push_back(child);
  }

  // f(key, value) for a snapshot of dict `d`'s items in its own order (an exact dict is
  // read with PyDict_Next: no item tuples; a subclass such as OrderedDict through items()).
  template <class F>
  void for_items(PyObject* d, F&& f) {
    for_items(d, f, [](PyObject*) { return false; });
  }
  // ... leaving out the items whose key `skip(key)` names, unread (their values not touched)
  template <class F, class Skip>
  void for_items(PyObject* d, F&& f, Skip&& skip) {
    if (PyDict_CheckExact(d)) {
      // the snapshot goes on `held` (shared by nested calls, stack-wise: no allocation per
      // dict); its references keep the items alive whatever the visits run
      struct Release {  // drops the snapshot, also when a visit throws
        std::vector<PyObject*>& held;
        size_t base;
        ~Release() {
          for (size_t i = base; i < held.size(); ++i) Py_DECREF(held[i]);
          held.resize(base);
        }
      } release{held, held.size()};
      const size_t base = release.base;
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      held.reserve(base + 2 * size_t(PyDict_GET_SIZE(d)));  // no push_back below can throw
      while (PyDict_Next(d, &pos, &k, &v)) {
        if (skip(k)) continue;
        Py_INCREF(k), Py_INCREF(v);
        held.push_back(k), held.push_back(v);
      }
      for (size_t i = base, end = held.size(); i < end; i += 2) f(held[i], held[i + 1]);
      return;
    }
    py::object items = py::reinterpret_steal<py::object>(PyMapping_Items(d));  // d.items()
    if (!items) throw py::error_already_set();
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(items.ptr()); i < n; ++i) {
      // `for k, v in list(d.items())`: a subclass's items() may give anything
      py::object kv = py::reinterpret_steal<py::object>(
          PySequence_Tuple(PyList_GET_ITEM(items.ptr(), i)));
      if (!kv) throw py::error_already_set();
      if (PyTuple_GET_SIZE(kv.ptr()) != 2)
        throw py::value_error("scan_graph: items() of a " + std::string(Py_TYPE(d)->tp_name) +
                              " gave " + std::to_string(PyTuple_GET_SIZE(kv.ptr())) +
                              " values to unpack (expected 2)");
      if (!skip(PyTuple_GET_ITEM(kv.ptr(), 0)))
        f(PyTuple_GET_ITEM(kv.ptr(), 0), PyTuple_GET_ITEM(kv.ptr(), 1));
    }
  }

  // Whether getattr(obj, "__dict__") can give anything for objects of `type`: an instance
  // dict, or a `__dict__` the class defines. Asking objects without one costs an
  // AttributeError each (a formatted message); decided once per type.
  bool has_dict(PyTypeObject* type) {
    TypeFacts& f = facts_of(type);
    if (f.dict < 0) f.dict = has_dict_slow(type);
    return f.dict;
  }
  bool has_dict_slow(PyTypeObject* type) {
    bool found;
    char& known = dict_types.get(type, &found);
    if (!found)
      known = type->tp_dictoffset != 0 || _PyType_Lookup(type, s_dict.ptr()) != nullptr;
    return known;
  }

  void children(PyObject* obj, bool in_metadata) {
    if (PyDict_Check(obj)) {  // list(obj.items()): a snapshot, in the mapping's own order
      for_items(obj, [&](PyObject* k, PyObject* v) {
        if (is_tensor(k)) visit(obj, kDictKey, k, k, in_metadata);
        visit(obj, kItem, k, v, in_metadata);
      });
      return;
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
      const bool list = PyList_Check(obj);
      py::object seq = py::reinterpret_steal<py::object>(PySequence_Tuple(obj));
      if (!seq) throw py::error_already_set();
      for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(seq.ptr()); i < n; ++i) {
        py::object idx = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(i));
        visit(obj, list ? kItem : kTuple, idx.ptr(), PyTuple_GET_ITEM(seq.ptr(), i), in_metadata);
      }
      return;
    }
    if (is_set(obj)) {
      py::object seq = py::reinterpret_steal<py::object>(PySequence_Tuple(obj));
      if (!seq) throw py::error_already_set();
      for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(seq.ptr()); i < n; ++i)
        visit(obj, kTuple, Py_None, PyTuple_GET_ITEM(seq.ptr(), i), in_metadata);
      return;
    }
    if (has_dict(Py_TYPE(obj))) {
      py::object d = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, s_dict.ptr()));
      if (!d) {  // getattr(obj, "__dict__", None): only AttributeError means "none"
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
        PyErr_Clear();
      }
      if (d && PyDict_Check(d.ptr())) {
        const bool hooks = owns_hooks(obj);
        const py::object skip_set = in_metadata ? skipped_fields(obj) : py::none();
        PyObject* skip = skip_set.is_none() ? nullptr : skip_set.ptr();
        for_items(d.ptr(), [&](PyObject* k, PyObject* v) { visit(obj, kAttr, k, v, in_metadata); },
                  [&](PyObject* k) {
                    return (hooks && PyUnicode_CheckExact(k) && is_hook_attr(k)) ||
                           (skip && PyUnicode_CheckExact(k) && contains(skip, k));
                  });
      }
    }
    PyObject* type = (PyObject*)Py_TYPE(obj);
    py::object names = py::reinterpret_borrow<py::object>(
        PyDict_GetItemWithError(names_of.ptr(), type));  // held: the visits may run Python
    if (!names) {
      if (PyErr_Occurred()) throw py::error_already_set();
      py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(slot_names, obj));
      if (!r) throw py::error_already_set();
      if (!PyTuple_Check(r.ptr())) throw py::type_error("scan_graph: slot_names gave no tuple");
      names_of[py::handle(type)] = r;
      names = r;
    }
    const py::object skip_set = in_metadata && PyTuple_GET_SIZE(names.ptr())
        ? skipped_fields(obj) : py::none();
    PyObject* skip = skip_set.is_none() ? nullptr : skip_set.ptr();
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(names.ptr()); i < n; ++i) {
      PyObject* name = PyTuple_GET_ITEM(names.ptr(), i);
      if (skip && contains(skip, name)) continue;
      py::object v = py::reinterpret_steal<py::object>(PyObject_GenericGetAttr(obj, name));
      if (!v) {  // object.__getattribute__ raised: an empty slot is skipped
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
        PyErr_Clear();
        continue;
      }
      visit(obj, kSlot, name, v.ptr(), in_metadata);
    }
  }
};

}  // namespace

void metamat_bind_graph(py::module_& m) {
  // ids are ints (graph.py's views key by id(obj), as the Python walk's dicts do)
  py::class_<GraphRecord>(m, "GraphRecord", "What scan_graph found (bindings_graph.cpp).")
      .def(py::init<>())
      .def("__len__", [](const GraphRecord& r) { return r.objects.size(); })
      .def("with_slots", [](const GraphRecord& r) { return r.with_slots; },
           "How many objects have at least one slot.")
      .def("objects", [](const GraphRecord& r) {
             py::list out(r.objects.size());
             for (size_t i = 0; i < r.objects.size(); ++i) {
               Py_INCREF(r.objects[i].obj);
               PyList_SET_ITEM(out.ptr(), Py_ssize_t(i), r.objects[i].obj);
             }
             return out;
           }, "Every object recorded, roots first, then in the order first reached.")
      .def("ids_with_slots", [](const GraphRecord& r) {
             // in the order of their first slots: the Python walk's dict order
             std::vector<std::pair<uint32_t, PyObject*>> firsts;
             for (const GraphRecord::Object& o : r.objects)
               if (o.first != GraphRecord::kNone) firsts.emplace_back(o.first, o.obj);
             std::sort(firsts.begin(), firsts.end());
             py::list out;
             for (const auto& f : firsts) {
               py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(f.second));
               if (!id || PyList_Append(out.ptr(), id.ptr()) < 0) throw py::error_already_set();
             }
             return out;
           }, "ids of the objects with at least one slot, in the order of their first slots.")
      .def("object", [](const GraphRecord& r, py::handle id) -> py::object {
             const uint32_t at = r.find(id);
             if (at == GraphRecord::kNone) {
               PyErr_SetObject(PyExc_KeyError, id.ptr());
               throw py::error_already_set();
             }
             return py::reinterpret_borrow<py::object>(r.objects[at].obj);
           }, "The object whose id is `id` (KeyError if not recorded).")
      .def("first_slot", [](const GraphRecord& r, py::handle id) -> py::object {
             const uint32_t at = r.find(id);
             if (at == GraphRecord::kNone || r.objects[at].first == GraphRecord::kNone)
               return py::none();
             return r.make_slot(r.slots[r.objects[at].first]);
           }, "The first Slot referring to the object whose id is `id` (where the walk first "
              "reached it), or None.")
      .def("has", [](const GraphRecord& r, py::handle id) {
             return r.find(id) != GraphRecord::kNone;
           })
      .def("has_slots", [](const GraphRecord& r, py::handle id) {
             const uint32_t at = r.find(id);
             return at != GraphRecord::kNone && r.objects[at].first != GraphRecord::kNone;
           })
      .def("tuple_held", [](const GraphRecord& r) {
             py::set out;
             for (const GraphRecord::Object& o : r.objects)
               for (uint32_t i = o.first; i != GraphRecord::kNone; i = r.slots[i].next)
                 if (r.slots[i].kind == GraphRecord::kTuple) {  // immutable: cannot be swapped
                   py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(o.obj));
                   if (!id || PySet_Add(out.ptr(), id.ptr()) < 0) throw py::error_already_set();
                   break;
                 }
             return out;
           }, "ids of the objects held in a tuple, set or frozenset (a slot of kind \"tuple\").")
      .def("slots", [](const GraphRecord& r, py::handle id) { return r.slots_of(r.find(id)); },
           "A new list of the Slots referring to the object whose id is `id` ([] if none).");

  m.def(
      "scan_graph",
      [](py::list roots, GraphRecord& rec, py::list tensors, py::dict kinds, py::object kind_of,
         py::object slot_names, py::object slot_type, py::object tensor, py::object device,
         py::list device_refs, py::tuple hook_owners, py::frozenset hook_attrs,
         py::dict metadata_skip, py::tuple later_types) {
        if (!PyType_Check(slot_type.ptr()) ||
            !PyType_IsSubtype((PyTypeObject*)slot_type.ptr(), &PyTuple_Type))
          throw py::type_error("scan_graph: slot_type must be a tuple subclass");
        if (!rec.objects.empty()) throw py::value_error("scan_graph: the record must be new");
        rec.slot_type = slot_type;
        Walk w;
        w.rec = &rec;
        w.tensors = tensors.ptr(), w.kinds = kinds.ptr(), w.kind_of = kind_of.ptr();
        w.slot_names = slot_names.ptr(), w.tensor = tensor.ptr();
        w.device = device.ptr(), w.device_refs = device_refs.ptr();
        w.hook_owners = hook_owners.ptr(), w.hook_attrs = hook_attrs.ptr();
        w.metadata_skip = metadata_skip.ptr(), w.later_types = later_types.ptr();
        for (py::handle r : roots) {
          bool added;
          rec.add(r.ptr(), &added);
          w.queue.push_back(r.ptr());
        }
        // both queues grow while walked; `later` is read only when `queue` has run empty
        for (size_t head = 0, next = 0;;) {
          PyObject* obj;
          if (head < w.queue.size()) obj = w.queue[head++];
          else if (next < w.later.size()) obj = w.later[next++];
          else break;
          if (Py_TYPE(obj) == (PyTypeObject*)tensor.ptr()) continue;  // plain tensors
          w.children(obj, false);
        }
      },
      "Walk the object graph from `roots` into the new GraphRecord `rec` (roots first), and "
      "fill `tensors` (every tensor reached but the roots, in scan order) and `device_refs`, as "
      "graph.scan_reference does.");
}
