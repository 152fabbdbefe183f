// The core's result structs as Python dicts, each field named once: the key is the field's own
// name (MM_FIELD), so a dict cannot drift from its struct. Bindings only.
#pragma once
#include <pybind11/pybind11.h>

#include <utility>

#include "metamat/fill.h"

// {"name", &S::name}: one field of struct S, for as_dict.
#define MM_FIELD(S, name) std::make_pair(#name, &S::name)

namespace metamat_py {

namespace py = pybind11;

// A dict of the given fields of `s`: as_dict(st, MM_FIELD(S, a), MM_FIELD(S, b)).
template <class S, class... M>
py::dict as_dict(const S& s, std::pair<const char*, M S::*>... fields) {
  py::dict d;
  ((d[fields.first] = s.*(fields.second)), ...);
  return d;
}

// What the host emulation of the CUDA launch did (fill_cuda_emulated, with or without a variant).
inline py::dict emulation_dict(const metamat::EmulationStats& st) {
  using S = metamat::EmulationStats;
  return as_dict(st, MM_FIELD(S, tiles), MM_FIELD(S, segments), MM_FIELD(S, philox_calls),
                 MM_FIELD(S, vector_stores), MM_FIELD(S, vector_bytes),
                 MM_FIELD(S, scalar_stores));
}

}  // namespace metamat_py
