// The compiled block index of each tier, as Python sees it: ``sglang_kvbm._blocks``.

#include <nanobind/nanobind.h>

#include "block_index.h"

namespace nb = nanobind;
using kvbm::BlockIndex;

namespace {

// Per id of the leading run held by any of ``indexes``: a byte whose bit i says indexes[i] registers it.
// The run ends at the first id none of them holds (the chain's lookups stop there; the rest is not read).
nb::bytes held_by(nb::handle ids, nb::handle index_seq) {
    kvbm::Items given(index_seq);
    if (given.n > 8) throw nb::value_error("held_by: at most 8 indexes");
    nb::object held[8];  // owned: the list may change once Python code runs
    const BlockIndex *indexes[8];
    size_t count = 0;
    for (Py_ssize_t t = 0; t < given.n; ++t) {
        nb::handle h(given.items[t]);
        const BlockIndex *index = nullptr;
        if (h.is_none() || !nb::try_cast<const BlockIndex *>(h, index) || !index)
            throw nb::type_error((std::string("held_by: indexes are BlockIndex objects, not ") + Py_TYPE(h.ptr())->tp_name).c_str());
        held[count] = nb::borrow(h);
        indexes[count++] = index;
    }
    kvbm::Items it(ids);
    std::string out;
    out.reserve(size_t(it.n));
    for (Py_ssize_t i = 0; i < it.n; ++i) {
        kvbm::Key key = kvbm::parse(it.items[i]);
        uint8_t mask = 0;
        for (size_t t = 0; t < count; ++t)
            if (indexes[t]->registered_slot(key) >= 0) mask |= uint8_t(1u << t);
        if (!mask) break;
        out.push_back(char(mask));
    }
    return nb::bytes(out.data(), out.size());
}

// The payloads an index keeps may refer back to it (a cycle only the collector can break).
int index_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    if (!nb::inst_ready(self)) return 0;
    return nb::inst_ptr<BlockIndex>(self)->traverse(visit, arg);
}

int index_clear(PyObject *self) {
    if (nb::inst_ready(self)) nb::inst_ptr<BlockIndex>(self)->clear_payloads();
    return 0;
}

PyType_Slot index_slots[] = {
    {Py_tp_traverse, reinterpret_cast<void *>(index_traverse)},
    {Py_tp_clear, reinterpret_cast<void *>(index_clear)},
    {0, nullptr},
};

}  // namespace

NB_MODULE(_blocks, m) {
    m.doc() = "The compiled block index of each tier (see csrc/block_index.h).";
    // An index lives as long as its tier; at interpreter exit some still do (daemon copy threads hold theirs).
    nb::set_leak_warnings(false);
    nb::exception<kvbm::BlockStateError>(m, "BlockStateError", PyExc_RuntimeError);
    nb::class_<BlockIndex>(m, "BlockIndex", nb::type_slots(index_slots))
        .def(nb::init<int32_t, bool>(), nb::arg("capacity"), nb::arg("all_free") = true)
        .def_prop_ro("capacity", &BlockIndex::capacity)
        .def("__len__", &BlockIndex::size)
        .def("__contains__", &BlockIndex::registered)
        .def("holds", &BlockIndex::holds)
        .def("registered", &BlockIndex::registered)
        .def("slot", &BlockIndex::slot)
        .def("slots", &BlockIndex::slots)
        .def("run", &BlockIndex::run)
        .def("missing", &BlockIndex::missing)
        .def("flags", &BlockIndex::flags)
        .def("reserve", &BlockIndex::reserve)
        .def("commit", &BlockIndex::commit)
        .def("restore", &BlockIndex::restore)
        .def("abort", &BlockIndex::abort)
        .def("release_orphans", &BlockIndex::release_orphans)
        .def("touch", &BlockIndex::touch)
        .def("pin", &BlockIndex::pin)
        .def("unpin", &BlockIndex::unpin)
        .def("pinned", [](const BlockIndex &index, nb::handle id) { return index.pins(id) > 0; })
        .def("pins", &BlockIndex::pins)
        .def("remove", &BlockIndex::remove, nb::arg("ids"), nb::arg("skip_pinned") = false)
        .def("drop_slots", &BlockIndex::drop_slots)
        .def("forget", &BlockIndex::forget, nb::arg("keep_pinned"))
        .def("payload", &BlockIndex::payload)
        .def("payloads", &BlockIndex::payloads)
        .def("items", &BlockIndex::items)
        .def("state", &BlockIndex::state)
        .def("free_count", &BlockIndex::free_count)
        .def("inflight_count", &BlockIndex::inflight_count)
        .def("pinned_count", &BlockIndex::pinned_count)
        .def("orphan_count", &BlockIndex::orphan_count)
        .def("set_free", &BlockIndex::set_free)
        .def("add_free", &BlockIndex::add_free);
    m.def("held_by", &held_by, nb::arg("ids"), nb::arg("indexes"));
}
