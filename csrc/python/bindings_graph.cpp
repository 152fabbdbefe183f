// pybind11 bindings of the object-graph walk (graph_walk.h) and its record (graph_record.h):
// `scan_graph` and `GraphRecord`, read by metamat/models/torchrec/graph.py.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "graph_record.h"
#include "graph_walk.h"

namespace py = pybind11;
using metamat_py::graph::GraphRecord;
using metamat_py::graph::Walk;

void metamat_bind_graph(py::module_& m) {
  // ids are ints (graph.py's views key by id(obj), as the Python walk's dicts do)
  py::class_<GraphRecord>(m, "GraphRecord", "What scan_graph found (graph_record.h).")
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
