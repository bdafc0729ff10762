// Python sequences in and out of the block index: a batch is read whole, into C++ values, before any
// call changes state.
//
// Borrowed references: ``Items`` hands out a sequence's items without a reference each. That is safe
// only while no Python code runs: Python code (an ``__index__``, a ``__repr__``, a generator, a
// payload's ``__del__``) may change or free the sequence's items. So a call reads its batches in this
// order: slot lists first (``slots_of`` re-reads the sequence after each call into Python and holds the
// item it calls), then id and payload sequences (reading them runs no Python code but on an error,
// which ends the call), then it checks and changes state, running no Python code until it returns.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "block_ids.h"

namespace kvbm {
namespace nb = nanobind;

// A sequence's items without copying (a list or tuple as is; anything else made a list once).
struct Items {
    PyObject *seq;
    Py_ssize_t n;
    PyObject **items;  // borrowed: valid while no Python code runs
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

// A vector of trivial items that keeps its first N inline: a scheduler-path batch (a node's pages) allocates
// nothing, a larger one allocates once (``reserve``) without zeroing.
template <class T, size_t N>
class SmallVec {
  public:
    SmallVec() = default;
    SmallVec(const SmallVec &) = delete;
    SmallVec &operator=(const SmallVec &) = delete;
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    T *data() { return data_; }
    const T *data() const { return data_; }
    T &operator[](size_t i) { return data_[i]; }
    const T &operator[](size_t i) const { return data_[i]; }
    const T *begin() const { return data_; }
    const T *end() const { return data_ + size_; }
    void push_back(const T &v) {
        if (size_ == cap_) grow(cap_ * 2);
        data_[size_++] = v;
    }
    void reserve(size_t n) {
        if (n > cap_) grow(n);
    }
    void resize(size_t n) {  // new items uninitialized
        reserve(n);
        size_ = n;
    }
    void assign(size_t n, const T &v) {
        if (n > cap_) grow(n);
        for (size_t i = 0; i < n; ++i) data_[i] = v;
        size_ = n;
    }

  private:
    T inline_[N];
    std::unique_ptr<T[]> heap_;  // default-initialized: not zeroed
    T *data_ = inline_;
    size_t size_ = 0, cap_ = N;

    void grow(size_t want) {
        std::unique_ptr<T[]> more(new T[want]);
        std::copy(data_, data_ + size_, more.get());
        heap_ = std::move(more);
        data_ = heap_.get();
        cap_ = want;
    }
};

using Slots = SmallVec<int32_t, 256>;
using Keys = SmallVec<Key, 128>;

[[noreturn]] inline void slot_out_of_range(long v, bool overflow, int32_t bound) {
    throw nb::index_error(("slot " + (overflow ? std::string("beyond a C long") : std::to_string(v)) +
                           " out of range [0, " + std::to_string(bound) + ")").c_str());
}

// ``array.array``, imported once with the module (``module.cpp``): slots go out as one ``array('i')``.
inline PyObject *&array_type() {
    static PyObject *type = nullptr;  // a strong reference, never released (the module lives as long)
    return type;
}

// Slots out as one ``array.array('i')`` of int32: no Python int made per slot, and read back (``slots_of``)
// in one copy. It indexes, iterates, slices and measures as a list of ints does.
inline nb::object int32_array(const int32_t *v, size_t n) {
    static_assert(sizeof(int) == sizeof(int32_t), "array('i') holds C ints");
    nb::object bytes = nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char *>(v), Py_ssize_t(n * 4)));
    if (!bytes.is_valid()) throw nb::python_error();
    PyObject *out = PyObject_CallFunction(array_type(), "sO", "i", bytes.ptr());
    if (!out) throw nb::python_error();
    return nb::steal(out);
}

// An int32 buffer (``array('i')``, what ``int32_array`` makes) into ``out``, checked against ``bound``; false
// (nothing read) for any other object. Runs no Python code.
inline bool slots_of_buffer(nb::handle h, int32_t bound, Slots &out) {
    if (!PyObject_CheckBuffer(h.ptr()) || PyBytes_Check(h.ptr()) || PyByteArray_Check(h.ptr())) return false;
    Py_buffer view;
    if (PyObject_GetBuffer(h.ptr(), &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return false;
    }
    const bool int32 = view.itemsize == 4 && view.format && (std::strcmp(view.format, "i") == 0 ||
                                                              std::strcmp(view.format, "=i") == 0);
    if (int32) {
        const size_t n = size_t(view.len / 4);
        out.resize(n);
        std::memcpy(out.data(), view.buf, n * 4);
        PyBuffer_Release(&view);
        for (size_t i = 0; i < n; ++i)
            if (out[i] < 0 || out[i] >= bound) slot_out_of_range(out[i], false, bound);
        return true;
    }
    PyBuffer_Release(&view);
    return false;
}

// A sequence of slots in [0, bound) into ``out``: an ``array('i')`` in one copy; else exact ints are read in
// place (no Python code runs); from the first item that is not one, each goes through ``__index__`` (TypeError
// when it has none) with the item held, and the sequence is re-read after each (an ``__index__`` may change it).
inline void slots_of(nb::handle h, int32_t bound, Slots &out) {
    if (slots_of_buffer(h, bound, out)) return;
    Items it(h);
    out.reserve(size_t(it.n));
    Py_ssize_t i = 0;
    for (; i < it.n && PyLong_CheckExact(it.items[i]); ++i) {
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(it.items[i], &overflow);
        if (overflow || v < 0 || v >= bound) slot_out_of_range(v, overflow, bound);
        out.push_back(int32_t(v));
    }
    for (; i < PySequence_Fast_GET_SIZE(it.seq); ++i) {
        nb::object held = nb::borrow(PySequence_Fast_GET_ITEM(it.seq, i));
        nb::object index = nb::steal(PyNumber_Index(held.ptr()));
        if (!index.is_valid()) throw nb::python_error();
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(index.ptr(), &overflow);
        if (v == -1 && PyErr_Occurred()) throw nb::python_error();
        if (overflow || v < 0 || v >= bound) slot_out_of_range(v, overflow, bound);
        out.push_back(int32_t(v));
    }
}

// Where a sequence of block ids is expected, a str or bytes alone is one id, not a sequence: refused.
inline void refuse_one_id(nb::handle h) {
    if (PyUnicode_Check(h.ptr()) || PyBytes_Check(h.ptr()))
        throw nb::type_error("expected a sequence of block ids, got one id");
}

// A sequence of block ids into ``out``.
inline void keys_of(nb::handle h, Keys &out) {
    refuse_one_id(h);
    Items it(h);
    out.reserve(size_t(it.n));
    for (Py_ssize_t i = 0; i < it.n; ++i) out.push_back(parse(it.items[i]));
}

// The position of the first id equal to an earlier one, or -1 (a small table of positions per call).
inline Py_ssize_t repeated_key(const Keys &keys) {
    size_t n = keys.size();
    if (n <= 4) {
        for (size_t i = 1; i < n; ++i)
            for (size_t j = 0; j < i; ++j)
                if (keys[i] == keys[j]) return Py_ssize_t(i);
        return -1;
    }
    size_t size = 32;
    while (size < 2 * n) size <<= 1;
    SmallVec<int32_t, 512> table;
    table.assign(size, -1);
    for (size_t i = 0; i < n; ++i) {
        size_t b = key_hash(keys[i]) & (size - 1);
        for (; table[b] >= 0; b = (b + 1) & (size - 1))
            if (keys[size_t(table[b])] == keys[i]) return Py_ssize_t(i);
        table[b] = int32_t(i);
    }
    return -1;
}

inline nb::list int_list(const int32_t *v, size_t n) {
    PyObject *l = PyList_New(Py_ssize_t(n));
    if (!l) throw nb::python_error();
    nb::list out = nb::steal<nb::list>(l);
    for (size_t i = 0; i < n; ++i) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (!x) throw nb::python_error();
        PyList_SET_ITEM(l, Py_ssize_t(i), x);
    }
    return out;
}

}  // namespace kvbm
