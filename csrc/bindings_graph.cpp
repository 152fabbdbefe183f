// The object-graph walk of metamat/models/torchrec/graph.py (`scan`), in C: a sharded model
// holds ~95 objects and ~140 references per embedding table, and the Python loop over them
// cost ~0.5 ms per table. Shard metadata (kind 3) is searched for devices only, containers of
// leaves and shared constants (enums, layouts, process groups: graph._LEAF_TYPES) are not
// recorded: ~32 objects and ~43 slots per table are. Torch-free: tensors are recognised by the
// type objects Python passes in. The Python `scan_reference` is the specification; tests
// compare the two on real models.
//
// Visit order and slot order are Python's (an object's first slot is where it was first
// reached): a stack of objects, each object's references in the order `_children` yields them
// (dict: a tensor key's "dictkey" before its "item"; then attributes of __dict__, then
// __slots__ names); metadata is searched depth-first when reached.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace {

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
  // Whether `key` is new (and now present).
  bool insert(const void* key) {
    bool found;
    get(key, &found);
    return !found;
  }

 private:
  size_t index(const void* key) const {
    // Fibonacci hashing of the address (objects are 16-byte aligned: the low bits carry none)
    return size_t((uint64_t(uintptr_t(key)) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void grow() {
    std::vector<const void*> keys(keys_.empty() ? 64 : 2 * keys_.size(), nullptr);
    std::vector<V> vals(keys.size());
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
  std::vector<const void*> keys_;
  std::vector<V> vals_;
  size_t size_ = 0;
  int shift_ = 64;
};

struct Walk {
  PyObject* objects;     // dict: id -> object
  PyObject* slots;       // dict (a defaultdict): id -> list of Slot
  PyObject* tensors;     // list of tensors reached, in scan order
  PyObject* kinds;       // dict: type -> 0/1/2 (graph._KIND)
  PyObject* kind_of;     // graph._kind_of(obj) for a type not in `kinds`
  PyObject* slot_names;  // graph.slot_names(obj) -> tuple of str
  PyObject* slot_type;   // graph.Slot
  PyObject* tensor;      // torch.Tensor
  PyObject* device;      // torch.device
  PyObject* device_refs; // list of (holder, key): attributes holding a torch.device or "meta"
  std::vector<PyObject*> stack;  // borrowed: every object on it is in `objects` or a root
  py::dict names_of;     // type -> slot names (cache of slot_names)
  py::str s_item{"item"}, s_tuple{"tuple"}, s_attr{"attr"}, s_slot{"slot"}, s_dictkey{"dictkey"},
      s_dict{"__dict__"}, s_meta{"meta"};

  PtrMap<char> tensor_types;  // isinstance(x, torch.Tensor) by type
  PtrMap<char> dict_types;    // has_dict, by type
  PtrMap<char> kind_cache;    // 1 + kind, by type (see kind())
  PtrMap<char> searched;      // metadata objects (and their containers) searched
  PtrMap<PyObject*> slot_lists;  // object -> its list in `slots` (borrowed: `slots` holds it)
  std::vector<PyObject*> held;  // for_items' snapshots of exact dicts (strong references)

  static bool is_container(PyObject* o) {
    return PyDict_Check(o) || PyList_Check(o) || PyTuple_Check(o) || PyAnySet_Check(o);
  }
  // graph._holds_nothing: a container whose every element (and key) is a leaf.
  bool holds_nothing(PyObject* o) {
    if (PyDict_Check(o)) {
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      while (PyDict_Next(o, &pos, &k, &v))
        if (kind(k) || kind(v)) return false;
      return true;
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
    bool found;
    char& known = tensor_types.get(Py_TYPE(o), &found);
    if (found) return known;
    const int r = PyObject_IsInstance(o, tensor);
    if (r < 0) throw py::error_already_set();
    // looked up again: any get() on a map may grow it and move the slot `known` named
    char& slot = tensor_types.get(Py_TYPE(o), &found);
    slot = r != 0;
    return r != 0;
  }

  // A torch.device, or the str "meta" (TorchRec keeps some devices as strings).
  bool is_device_value(PyObject* v) {
    if (Py_TYPE(v) == (PyTypeObject*)device) return true;
    return PyUnicode_CheckExact(v) && PyUnicode_Compare(v, s_meta.ptr()) == 0;
  }

  // graph._KIND of the child's type: asked once per reference (~150 per table), so kept
  // here too (1 + kind; 0: not asked yet). A type's kind never changes.
  int kind(PyObject* child) {
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
  void visit(PyObject* holder, PyObject* kind_name, PyObject* key, PyObject* child,
             bool in_metadata) {
    const int k = kind(child);
    if (!k) {
      if (kind_name == s_attr.ptr() && is_device_value(child)) {
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
      if (searched.insert(child) && !plain_leaves) children(child, true);
      return;
    }
    if (k == 1 && is_container(child) && holds_nothing(child)) return;  // not recorded
    py::object cid = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(child));
    // graph.Slot is a tuple subclass (holder, kind, key): built here without calling Python
    py::object slot = py::reinterpret_steal<py::object>(
        ((PyTypeObject*)slot_type)->tp_alloc((PyTypeObject*)slot_type, 3));
    if (slot) {
      PyObject* items[3] = {holder, kind_name, key};
      for (int i = 0; i < 3; ++i) Py_INCREF(items[i]), PyTuple_SET_ITEM(slot.ptr(), i, items[i]);
    }
    if (!cid || !slot) throw py::error_already_set();
    // Every object but a root gets its slot list when first reached, and the roots are
    // seeded with empty ones: one lookup tells a new object from a seen one. The lists are
    // also kept here by object (`slots` holds them): an `id` key of `slots` costs a new int,
    // its hash and a comparison with the int already there.
    bool seen;
    PyObject*& lst = slot_lists.get(child, &seen);
    if (seen) {
      if (PyList_Append(lst, slot.ptr()) < 0) throw py::error_already_set();
      return;
    }
    py::list fresh(1);
    PyList_SET_ITEM(fresh.ptr(), 0, slot.release().ptr());
    lst = fresh.ptr();  // before any other get() on slot_lists
    if (PyDict_SetItem(slots, cid.ptr(), fresh.ptr()) < 0) throw py::error_already_set();
    if (PyDict_SetItem(objects, cid.ptr(), child) < 0) throw py::error_already_set();
    if (k == 2) {
      if (PyList_Append(tensors, child) < 0) throw py::error_already_set();
      return;
    }
    if (is_tensor(child) && PyList_Append(tensors, child) < 0) throw py::error_already_set();
    stack.push_back(child);
  }

  // f(key, value) for a snapshot of dict `d`'s items in its own order (an exact dict is
  // read with PyDict_Next: no item tuples; a subclass such as OrderedDict through items()).
  template <class F>
  void for_items(PyObject* d, F&& f) {
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
        Py_INCREF(k), Py_INCREF(v);
        held.push_back(k), held.push_back(v);
      }
      for (size_t i = base, end = held.size(); i < end; i += 2) f(held[i], held[i + 1]);
      return;
    }
    py::object items = py::reinterpret_steal<py::object>(PyMapping_Items(d));  // d.items()
    if (!items) throw py::error_already_set();
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(items.ptr()); i < n; ++i) {
      PyObject* kv = PyList_GET_ITEM(items.ptr(), i);
      f(PyTuple_GET_ITEM(kv, 0), PyTuple_GET_ITEM(kv, 1));
    }
  }

  // Whether getattr(obj, "__dict__") can give anything for objects of `type`: an instance
  // dict, or a `__dict__` the class defines. Asking objects without one costs an
  // AttributeError each (a formatted message); decided once per type.
  bool has_dict(PyTypeObject* type) {
    bool found;
    char& known = dict_types.get(type, &found);
    if (!found)
      known = type->tp_dictoffset != 0 || _PyType_Lookup(type, s_dict.ptr()) != nullptr;
    return known;
  }

  void children(PyObject* obj, bool in_metadata) {
    if (PyDict_Check(obj)) {  // list(obj.items()): a snapshot, in the mapping's own order
      for_items(obj, [&](PyObject* k, PyObject* v) {
        if (is_tensor(k)) visit(obj, s_dictkey.ptr(), k, k, in_metadata);
        visit(obj, s_item.ptr(), k, v, in_metadata);
      });
      return;
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
      const bool list = PyList_Check(obj);
      py::object seq = py::reinterpret_steal<py::object>(PySequence_Tuple(obj));
      if (!seq) throw py::error_already_set();
      for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(seq.ptr()); i < n; ++i) {
        py::object idx = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(i));
        visit(obj, list ? s_item.ptr() : s_tuple.ptr(), idx.ptr(), PyTuple_GET_ITEM(seq.ptr(), i),
              in_metadata);
      }
      return;
    }
    if (PyAnySet_Check(obj)) {
      py::object seq = py::reinterpret_steal<py::object>(PySequence_Tuple(obj));
      if (!seq) throw py::error_already_set();
      for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(seq.ptr()); i < n; ++i)
        visit(obj, s_tuple.ptr(), Py_None, PyTuple_GET_ITEM(seq.ptr(), i), in_metadata);
      return;
    }
    if (has_dict(Py_TYPE(obj))) {
      py::object d = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, s_dict.ptr()));
      if (!d) {  // getattr(obj, "__dict__", None): only AttributeError means "none"
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
        PyErr_Clear();
      }
      if (d && PyDict_Check(d.ptr()))
        for_items(d.ptr(), [&](PyObject* k, PyObject* v) {
          visit(obj, s_attr.ptr(), k, v, in_metadata);
        });
    }
    PyObject* type = (PyObject*)Py_TYPE(obj);
    PyObject* names = PyDict_GetItemWithError(names_of.ptr(), type);  // borrowed
    if (!names) {
      if (PyErr_Occurred()) throw py::error_already_set();
      py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(slot_names, obj));
      if (!r || !PyTuple_Check(r.ptr())) throw py::error_already_set();
      names_of[py::handle(type)] = r;
      names = r.ptr();
    }
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(names); i < n; ++i) {
      PyObject* name = PyTuple_GET_ITEM(names, i);
      py::object v = py::reinterpret_steal<py::object>(PyObject_GenericGetAttr(obj, name));
      if (!v) {  // object.__getattribute__ raised: an empty slot is skipped
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
        PyErr_Clear();
        continue;
      }
      visit(obj, s_slot.ptr(), name, v.ptr(), in_metadata);
    }
  }
};

}  // namespace

void metamat_bind_graph(py::module_& m) {
  m.def(
      "scan_graph",
      [](py::list roots, py::dict objects, py::dict slots, py::list tensors,
         py::dict kinds, py::object kind_of, py::object slot_names, py::object slot_type,
         py::object tensor, py::object device, py::list device_refs) {
        if (!PyType_Check(slot_type.ptr()) ||
            !PyType_IsSubtype((PyTypeObject*)slot_type.ptr(), &PyTuple_Type))
          throw py::type_error("scan_graph: slot_type must be a tuple subclass");
        Walk w;
        w.objects = objects.ptr(), w.slots = slots.ptr();
        w.tensors = tensors.ptr(), w.kinds = kinds.ptr(), w.kind_of = kind_of.ptr();
        w.slot_names = slot_names.ptr(), w.slot_type = slot_type.ptr(), w.tensor = tensor.ptr();
        w.device = device.ptr(), w.device_refs = device_refs.ptr();
        std::vector<py::object> seeded;  // roots without a slot list: theirs is removed after
        for (py::handle r : roots) {
          w.stack.push_back(r.ptr());
          py::object rid = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(r.ptr()));
          if (!rid) throw py::error_already_set();
          PyObject* lst = PyDict_GetItemWithError(slots.ptr(), rid.ptr());  // borrowed
          if (!lst) {
            if (PyErr_Occurred()) throw py::error_already_set();
            py::list empty;
            if (PyDict_SetItem(slots.ptr(), rid.ptr(), empty.ptr()) < 0)
              throw py::error_already_set();
            lst = empty.ptr();  // `slots` holds it now
            seeded.push_back(rid);
          }
          bool seen;
          w.slot_lists.get(r.ptr(), &seen) = lst;
        }
        while (!w.stack.empty()) {
          PyObject* obj = w.stack.back();
          w.stack.pop_back();
          if (Py_TYPE(obj) == (PyTypeObject*)tensor.ptr()) continue;  // plain tensors
          w.children(obj, false);
        }
        for (const py::object& rid : seeded) {  // a root nothing refers to has no slots
          PyObject* lst = PyDict_GetItemWithError(slots.ptr(), rid.ptr());
          if (lst && PyList_GET_SIZE(lst) == 0 && PyDict_DelItem(slots.ptr(), rid.ptr()) < 0)
            throw py::error_already_set();
        }
      },
      "Walk the object graph from `roots` (already recorded in `objects`) and fill `objects`, "
      "`slots`, `tensors` and `device_refs` as graph.scan_reference does. `slots` must hold "
      "no entry but the roots' (graph.scan passes an empty one).");
}
