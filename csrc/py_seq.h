// Python sequences in and out of the block index, without a Python object per item on the way in.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvbm {
namespace nb = nanobind;

// A sequence's items without copying (a list or tuple as is; anything else made a list once).
struct Items {
    PyObject *seq;
    Py_ssize_t n;
    PyObject **items;
    explicit Items(nb::handle h) {
        seq = PySequence_Fast(h.ptr(), "expected a sequence");
        if (!seq) throw nb::python_error();
        n = PySequence_Fast_GET_SIZE(seq);
        items = PySequence_Fast_ITEMS(seq);
    }
    ~Items() { Py_DECREF(seq); }
    Items(const Items &) = delete;
    Items &operator=(const Items &) = delete;
};

inline std::vector<int32_t> ints(nb::handle h, int32_t bound) {
    Items it(h);
    std::vector<int32_t> out(it.n);
    for (Py_ssize_t i = 0; i < it.n; ++i) {
        long v = PyLong_AsLong(it.items[i]);
        if (v == -1 && PyErr_Occurred()) throw nb::python_error();
        if (v < 0 || v >= bound) throw nb::index_error(("slot " + std::to_string(v) + " out of range").c_str());
        out[i] = int32_t(v);
    }
    return out;
}

inline nb::list int_list(const int32_t *v, size_t n) {
    PyObject *l = PyList_New(Py_ssize_t(n));
    if (!l) throw nb::python_error();
    for (size_t i = 0; i < n; ++i) PyList_SET_ITEM(l, Py_ssize_t(i), PyLong_FromLong(v[i]));
    return nb::steal<nb::list>(l);
}

}  // namespace kvbm
