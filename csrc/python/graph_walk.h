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
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "graph_record.h"

namespace metamat_py {
namespace graph __attribute__((visibility("hidden"))) {  // as pybind11's own types

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

}  // namespace graph
}  // namespace metamat_py
