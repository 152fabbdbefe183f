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

#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

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
  py::list stack;
  py::dict names_of;     // type -> slot names (cache of slot_names)
  py::str s_item{"item"}, s_tuple{"tuple"}, s_attr{"attr"}, s_slot{"slot"}, s_dictkey{"dictkey"},
      s_dict{"__dict__"}, s_meta{"meta"};

  std::unordered_map<PyTypeObject*, bool> tensor_types;  // isinstance(x, torch.Tensor) by type
  std::unordered_map<PyTypeObject*, bool> dict_types;  // has_dict, by type
  std::unordered_set<PyObject*> searched;  // metadata objects (and their containers) searched

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
    py::object seq = py::reinterpret_steal<py::object>(PySequence_Tuple(o));
    if (!seq) throw py::error_already_set();
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(seq.ptr()); i < n; ++i)
      if (kind(PyTuple_GET_ITEM(seq.ptr(), i))) return false;
    return true;
  }

  // isinstance(o, torch.Tensor), decided once per type (~200 ns per call in Python: the
  // tensor metaclass); the walk's objects keep their types alive.
  bool is_tensor(PyObject* o) {
    auto it = tensor_types.find(Py_TYPE(o));
    if (it != tensor_types.end()) return it->second;
    const int r = PyObject_IsInstance(o, tensor);
    if (r < 0) throw py::error_already_set();
    tensor_types.emplace(Py_TYPE(o), r != 0);
    return r != 0;
  }

  // A torch.device, or the str "meta" (TorchRec keeps some devices as strings).
  bool is_device_value(PyObject* v) {
    if (Py_TYPE(v) == (PyTypeObject*)device) return true;
    return PyUnicode_CheckExact(v) && PyUnicode_Compare(v, s_meta.ptr()) == 0;
  }

  int kind(PyObject* child) {
    PyObject* k = PyDict_GetItemWithError(kinds, (PyObject*)Py_TYPE(child));  // borrowed
    if (k) return int(PyLong_AsLong(k));
    if (PyErr_Occurred()) throw py::error_already_set();
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(kind_of, child));
    if (!r) throw py::error_already_set();
    return int(PyLong_AsLong(r.ptr()));
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
      if (searched.insert(child).second) children(child, true);  // now, not recorded
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
    // seeded with empty ones: one lookup tells a new object from a seen one.
    PyObject* lst = PyDict_GetItemWithError(slots, cid.ptr());  // borrowed; no __missing__
    if (lst) {
      if (PyList_Append(lst, slot.ptr()) < 0) throw py::error_already_set();
      return;
    }
    if (PyErr_Occurred()) throw py::error_already_set();
    py::list fresh(1);
    PyList_SET_ITEM(fresh.ptr(), 0, slot.release().ptr());
    if (PyDict_SetItem(slots, cid.ptr(), fresh.ptr()) < 0) throw py::error_already_set();
    if (PyDict_SetItem(objects, cid.ptr(), child) < 0) throw py::error_already_set();
    if (k == 2) {
      if (PyList_Append(tensors, child) < 0) throw py::error_already_set();
      return;
    }
    if (is_tensor(child) && PyList_Append(tensors, child) < 0) throw py::error_already_set();
    stack.append(py::handle(child));
  }

  // f(key, value) for a snapshot of dict `d`'s items in its own order (an exact dict is
  // read with PyDict_Next: no item tuples; a subclass such as OrderedDict through items()).
  template <class F>
  void for_items(PyObject* d, F&& f) {
    if (PyDict_CheckExact(d)) {
      std::vector<py::object> kv;
      kv.reserve(2 * size_t(PyDict_GET_SIZE(d)));
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      while (PyDict_Next(d, &pos, &k, &v))
        kv.push_back(py::reinterpret_borrow<py::object>(k)),
            kv.push_back(py::reinterpret_borrow<py::object>(v));
      for (size_t i = 0; i < kv.size(); i += 2) f(kv[i].ptr(), kv[i + 1].ptr());
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
    auto it = dict_types.find(type);
    if (it != dict_types.end()) return it->second;
    const bool r = type->tp_dictoffset != 0 || _PyType_Lookup(type, s_dict.ptr()) != nullptr;
    dict_types.emplace(type, r);
    return r;
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
          w.stack.append(r);
          py::object rid = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(r.ptr()));
          if (!rid) throw py::error_already_set();
          if (!PyDict_GetItemWithError(slots.ptr(), rid.ptr())) {
            if (PyErr_Occurred()) throw py::error_already_set();
            if (PyDict_SetItem(slots.ptr(), rid.ptr(), py::list().ptr()) < 0)
              throw py::error_already_set();
            seeded.push_back(rid);
          }
        }
        while (PyList_GET_SIZE(w.stack.ptr()) > 0) {
          const Py_ssize_t last = PyList_GET_SIZE(w.stack.ptr()) - 1;
          py::object obj = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(w.stack.ptr(), last));
          if (PyList_SetSlice(w.stack.ptr(), last, last + 1, nullptr) < 0)
            throw py::error_already_set();
          if (Py_TYPE(obj.ptr()) == (PyTypeObject*)tensor.ptr()) continue;  // plain tensors
          w.children(obj.ptr(), false);
        }
        for (const py::object& rid : seeded) {  // a root nothing refers to has no slots
          PyObject* lst = PyDict_GetItemWithError(slots.ptr(), rid.ptr());
          if (lst && PyList_GET_SIZE(lst) == 0 && PyDict_DelItem(slots.ptr(), rid.ptr()) < 0)
            throw py::error_already_set();
        }
      },
      "Walk the object graph from `roots` (already recorded in `objects`) and fill `objects`, "
      "`slots`, `tensors` and `device_refs` as graph.scan_reference does.");
}
