// Segment packing for fill_many_: the per-item loop of metamat/init.py `_pack_columns`
// for plain items, in C (torch-free: tensors are read through their Python attributes, as
// Python would). It packs items from `start` on and returns the index of the first item it
// does not take: anything unusual (a 3-D tensor, an int subclass as offset, a key that is
// not an exact str, any check that fails) goes back to Python, which validates it and raises
// the error with its message, so errors and their order are Python's alone.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "metamat/fill.h"
#include "keys.h"

namespace py = pybind11;

namespace {

struct DistRow {
  int32_t kind;
  float p[4], clamp[2];
};

// An int >= 0 that fits int64, or -1.
int64_t plain_nonneg(PyObject* o) {
  if (!PyLong_CheckExact(o)) return -1;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || v < 0) {
    PyErr_Clear();
    return -1;
  }
  return v;
}

// A new reference to o.name(), or null (error cleared).
PyObject* call0(PyObject* o, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(o, name);
  if (!r) PyErr_Clear();
  return r;
}

// The tensor's geometry as Python's _block_geometry computes it; false if not plain.
bool geometry(PyObject* t, int64_t ro, int64_t co, int64_t* g, PyObject* s_shape,
              PyObject* s_stride) {
  py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_shape));
  if (!shape || !PyTuple_Check(shape.ptr())) return PyErr_Clear(), false;
  const Py_ssize_t nd = PyTuple_GET_SIZE(shape.ptr());
  if (nd != 1 && nd != 2) return false;
  py::object stride = py::reinterpret_steal<py::object>(call0(t, s_stride));
  if (!stride || !PyTuple_Check(stride.ptr()) || PyTuple_GET_SIZE(stride.ptr()) != nd) return false;
  int64_t dims[2], st[2];
  for (Py_ssize_t k = 0; k < nd; ++k) {
    dims[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), k));
    st[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride.ptr(), k));
  }
  if (PyErr_Occurred()) return PyErr_Clear(), false;
  if (nd == 1) {  // one row of its table; one offset
    if (ro && co) return false;
    if (dims[0] > 1 && st[0] != 1) return false;
    g[0] = 1, g[1] = dims[0], g[2] = dims[0], g[3] = 0, g[4] = ro + co;
    return true;
  }
  const int64_t rows = dims[0], cols = dims[1];
  if (cols > 1 && rows > 0 && st[1] != 1) return false;
  if (rows > 1 && st[0] < cols) return false;
  g[0] = rows, g[1] = cols, g[2] = st[0] > cols ? st[0] : cols, g[3] = ro, g[4] = co;
  return true;
}

}  // namespace

void metamat_bind_pack(py::module_& m) {
  m.def(
      "pack_segments",
      [](py::sequence items, Py_ssize_t start, uintptr_t segs_addr, uintptr_t devs_addr,
         py::handle tensor_type, py::tuple dtypes, py::dict dists, uint64_t seed) -> Py_ssize_t {
        auto* segs = reinterpret_cast<metamat::Segment*>(segs_addr);
        auto* devs = reinterpret_cast<int64_t*>(devs_addr);
        std::unordered_map<PyObject*, DistRow> dist_rows;  // id(dist) -> parameters
        for (auto kv : dists) {
          DistRow r;
          py::tuple v = kv.second.cast<py::tuple>();
          r.kind = v[0].cast<int32_t>();
          for (int k = 0; k < 4; ++k) r.p[k] = v[1 + k].cast<float>();
          for (int k = 0; k < 2; ++k) r.clamp[k] = v[5 + k].cast<float>();
          dist_rows[reinterpret_cast<PyObject*>(kv.first.cast<uintptr_t>())] = r;
        }
        static PyObject* s_dtype = PyUnicode_InternFromString("dtype");
        static PyObject* s_get_device = PyUnicode_InternFromString("get_device");
        static PyObject* s_is_cpu = PyUnicode_InternFromString("is_cpu");
        static PyObject* s_is_cuda = PyUnicode_InternFromString("is_cuda");
        static PyObject* s_shape = PyUnicode_InternFromString("shape");
        static PyObject* s_stride = PyUnicode_InternFromString("stride");
        static PyObject* s_data_ptr = PyUnicode_InternFromString("data_ptr");
        const Py_ssize_t n = py::len(items);
        for (Py_ssize_t i = start; i < n; ++i) {
          py::object item = items[i];
          PyObject* it = item.ptr();
          if (!(PyTuple_CheckExact(it) || PyList_CheckExact(it)) || PySequence_Fast_GET_SIZE(it) != 5)
            return i;
          py::object fo[5];  // own references: attribute code may mutate a list item
          PyObject* f[5];
          for (int k = 0; k < 5; ++k) {
            fo[k] = py::reinterpret_borrow<py::object>(PySequence_Fast_ITEMS(it)[k]);
            f[k] = fo[k].ptr();
          }
          PyObject* t = f[0];
          if (!PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(tensor_type.ptr()))) return i;
          auto dr = dist_rows.find(f[1]);
          if (dr == dist_rows.end()) return i;
          py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(t, s_dtype));
          if (!dtype) return PyErr_Clear(), i;
          int32_t code = 0;
          for (size_t k = 0; k < dtypes.size(); ++k)
            if (dtypes[k].ptr() == dtype.ptr()) code = static_cast<int32_t>(k) + 1;
          if (code == 0) return i;
          py::object dev_o = py::reinterpret_steal<py::object>(call0(t, s_get_device));
          if (!dev_o) return i;
          const int64_t dev = PyLong_AsLongLong(dev_o.ptr());
          py::object on = py::reinterpret_steal<py::object>(
              PyObject_GetAttr(t, dev < 0 ? s_is_cpu : s_is_cuda));
          if (!on || on.ptr() != Py_True) return PyErr_Clear(), i;
          const int64_t ro = plain_nonneg(f[3]), co = plain_nonneg(f[4]);
          if (ro < 0 || co < 0) return i;
          int64_t g[5];
          if (!geometry(t, ro, co, g, s_shape, s_stride)) return i;
          if (!PyUnicode_CheckExact(f[2])) return i;
          Py_ssize_t len = 0;
          const char* name = PyUnicode_AsUTF8AndSize(f[2], &len);
          if (!name) return PyErr_Clear(), i;
          const uint64_t k64 = metamat::philox_key(seed, name, static_cast<size_t>(len));
          py::object ptr_o = py::reinterpret_steal<py::object>(call0(t, s_data_ptr));
          if (!ptr_o) return i;
          const uint64_t ptr = PyLong_AsUnsignedLongLong(ptr_o.ptr());
          if (PyErr_Occurred()) return PyErr_Clear(), i;
          metamat::Segment& s = segs[i];
          s = metamat::Segment{};
          s.ptr = ptr;
          s.rows = g[0], s.cols = g[1], s.row_stride = g[2], s.row_offset = g[3], s.col_offset = g[4];
          s.key = k64;
          s.dtype = code;
          s.dist.kind = dr->second.kind;
          s.dist.p0 = dr->second.p[0], s.dist.p1 = dr->second.p[1];
          s.dist.p2 = dr->second.p[2], s.dist.p3 = dr->second.p[3];
          s.dist.clamp_lo = dr->second.clamp[0], s.dist.clamp_hi = dr->second.clamp[1];
          devs[i] = dev;
        }
        return n;
      },
      py::arg("items"), py::arg("start"), py::arg("segments_addr"), py::arg("devices_addr"),
      py::arg("tensor_type"), py::arg("dtypes"), py::arg("dists"), py::arg("seed"),
      "Pack plain fill items from `start` into Segments (and each item's device index, -1 for\n"
      "CPU); returns the index of the first item left to Python (len(items) when all done).\n"
      "dtypes: the dtype objects of codes 1, 2, ...; dists: {id(dist): (kind, p0..p3, lo, hi)};\n"
      "seed: the run's seed (keys as metamat.keys.philox_key, computed here).");

  m.def(
      "philox_key",
      [](uint64_t seed, const std::string& name) {
        return metamat::philox_key(seed, name.data(), name.size());
      },
      py::arg("seed"), py::arg("name"), "The packer's table key (tests compare it with keys.py).");
}
