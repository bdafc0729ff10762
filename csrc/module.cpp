// The compiled block index of each tier, as Python sees it: ``sglang_kvbm._blocks``.

#include <nanobind/nanobind.h>

#include "block_index.h"
#include "pages.h"

namespace nb = nanobind;
using kvbm::BlockIndex;

// Parameter types in the signatures Python sees (the `_blocks.pyi` stub is generated from them).
#define IDS "collections.abc.Sequence[str | bytes]"
#define SLOTS "collections.abc.Sequence[int]"
#define OBJECTS "collections.abc.Sequence[object]"

namespace {

// Per id of the leading run held by any of ``indexes``: a byte whose bit i says indexes[i] registers it.
// The run ends at the first id none of them holds (the chain's lookups stop there; the rest is not read).
// ``touch``: then the blocks of that run indexes[0] registers are made most recently used, as
// ``indexes[0].touch(ids[:len(run)])`` would, from the slots found (no id read twice), and indexes[0]
// remembers the run (``BlockIndex::remember``): the load that pins it follows, then the offload of the node it
// became.
nb::bytes held_by(nb::handle ids, nb::handle index_seq, bool touch) {
    kvbm::Items given(index_seq);
    if (given.n > 8) throw nb::value_error("held_by: at most 8 indexes");
    nb::object held[8];  // owned: the list may change once Python code runs
    const BlockIndex *indexes[8];
    size_t count = 0;
    for (Py_ssize_t t = 0; t < given.n; ++t) {
        nb::handle h(given.items[t]);
        const BlockIndex *index = nullptr;
        if (h.is_none() || !nb::try_cast<const BlockIndex *>(h, index) || !index)
            throw nb::type_error(
                (std::string("held_by: indexes are BlockIndex objects, not ") + Py_TYPE(h.ptr())->tp_name).c_str());
        held[count] = nb::borrow(h);
        indexes[count++] = index;
    }
    if (touch && !count) throw nb::value_error("held_by: touch needs an index to touch");
    kvbm::Items it(ids);
    std::string out;
    out.reserve(size_t(it.n));
    kvbm::Slots first;  // indexes[0]'s slot per id of the run (-1: not there), for ``touch``
    std::vector<kvbm::Key> keys;  // of the run, for ``touch``'s ``remember``
    kvbm::IdGroup g;
    int32_t found[8][kvbm::IdGroup::N];
    int32_t after[8];  // per index, the slot of the id before the group
    std::fill(after, after + 8, BlockIndex::FIRST_OF_BATCH);
    for (Py_ssize_t i = 0; i < it.n; i += kvbm::IdGroup::N) {
        g.read(it.items, it.n, i);
        for (size_t t = 0; t < count; ++t) indexes[t]->find_group(g.key, g.ok, g.n, true, found[t], after[t]);
        Py_ssize_t j = 0;
        for (; j < g.n; ++j) {
            if (!g.ok[j]) kvbm::bad_id(it.items[i + j]);
            uint8_t mask = 0;
            for (size_t t = 0; t < count; ++t)
                if (found[t][j] >= 0) mask |= uint8_t(1u << t);
            if (!mask) break;
            out.push_back(char(mask));
            if (touch) {
                first.push_back(found[0][j]);
                keys.push_back(g.key[j]);
            }
        }
        if (j < g.n) break;
    }
    if (touch) {  // held[0] keeps it alive
        auto *first_index = const_cast<BlockIndex *>(indexes[0]);
        first_index->touch_slots(first);
        first_index->remember(keys.data(), first.data(), Py_ssize_t(first.size()));
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
    m.doc() = "The compiled block index of each tier (csrc/block_index.h) and page records (csrc/pages.h).";
    // An index lives as long as its tier; at interpreter exit some still do (daemon copy threads hold theirs).
    nb::set_leak_warnings(false);
    kvbm::array_type() = nb::object(nb::module_::import_("array").attr("array")).release().ptr();
    nb::exception<kvbm::BlockStateError>(m, "BlockStateError", PyExc_RuntimeError);
    nb::class_<BlockIndex>(m, "BlockIndex", nb::type_slots(index_slots),
                           "Which slot of one tier holds which block: states, LRU with pins, payloads.")
        .def(nb::init<int32_t, bool>(), nb::arg("capacity"), nb::arg("all_free") = true)
        .def_prop_ro("capacity", &BlockIndex::capacity)
        .def("__len__", &BlockIndex::size)
        .def("__contains__", &BlockIndex::registered, nb::sig("def __contains__(self, id: str | bytes, /) -> bool"))
        .def("holds", &BlockIndex::holds, nb::sig("def holds(self, id: str | bytes, /) -> bool"),
             "Registered or being written here.")
        .def("registered", &BlockIndex::registered, nb::sig("def registered(self, id: str | bytes, /) -> bool"))
        .def("slot", &BlockIndex::slot, nb::sig("def slot(self, id: str | bytes, /) -> int | None"))
        .def("slots", &BlockIndex::slots, nb::sig("def slots(self, ids: " IDS ", /) -> list[int | None]"))
        .def("run", &BlockIndex::run, nb::sig("def run(self, ids: " IDS ", /) -> int"),
             "How many leading ids are registered (the ids after the first miss are not read).")
        .def("missing", &BlockIndex::missing, nb::sig("def missing(self, ids: " IDS ", /) -> list[int]"),
             "Positions of the ids neither registered nor being written.")
        .def("flags", &BlockIndex::flags, nb::sig("def flags(self, ids: " IDS ", /) -> bytes"))
        .def("reserve", &BlockIndex::reserve,
             nb::sig("def reserve(self, ids: " IDS ", /) -> tuple[list[int], list[object]]"),
             "Slots for the leading ids that find one, evicting least recently used blocks: (slots, evicted payloads).")
        .def("reserve_missing", &BlockIndex::reserve_missing,
             nb::sig("def reserve_missing(self, ids: " IDS ", /) -> tuple[list[int], list[int], list[object]]"),
             "missing + reserve in one call: (positions not held, slots for the leading ones, evicted payloads).")
        .def("commit", &BlockIndex::commit,
             nb::sig("def commit(self, slots: " SLOTS ", payloads: " OBJECTS ", /) -> None"),
             "Register reserved slots, the first most recent.")
        .def("restore", &BlockIndex::restore,
             nb::sig("def restore(self, slots: " SLOTS ", ids: " IDS ", payloads: " OBJECTS ", /) -> None"),
             "Blocks found at start-up into FREE slots, least recently used first.")
        .def("abort", &BlockIndex::abort, nb::sig("def abort(self, slots: " SLOTS ", /) -> None"))
        .def("release_orphans", &BlockIndex::release_orphans,
             nb::sig("def release_orphans(self, slots: " SLOTS ", /) -> None"))
        .def("touch", &BlockIndex::touch, nb::sig("def touch(self, ids: " IDS ", /) -> None"))
        .def("pin", &BlockIndex::pin, nb::sig("def pin(self, ids: " IDS ", /) -> array.array[int]"),
             "The slots, as one array('i'): a load's thousands of rows make no Python int each (unpin_slots and "
             "release_orphans read it back in one copy).")
        .def("unpin", &BlockIndex::unpin, nb::sig("def unpin(self, ids: " IDS ", /) -> None"))
        .def("unpin_slots", &BlockIndex::unpin_slots, nb::sig("def unpin_slots(self, slots: " SLOTS ", /) -> None"),
             "unpin by the slots pin returned (a slot dropped since is left alone).")
        .def("pinned", [](const BlockIndex &index, nb::handle id) { return index.pins(id) > 0; },
             nb::sig("def pinned(self, id: str | bytes, /) -> bool"))
        .def("pins", &BlockIndex::pins, nb::sig("def pins(self, id: str | bytes, /) -> int"))
        .def("remove", &BlockIndex::remove, nb::arg("ids"), nb::arg("skip_pinned") = false,
             nb::sig("def remove(self, ids: " IDS ", skip_pinned: bool = False) -> list[object]"))
        .def("drop_slots", &BlockIndex::drop_slots, nb::sig("def drop_slots(self, slots: " SLOTS ", /) -> list[object]"))
        .def("forget", &BlockIndex::forget, nb::arg("keep_pinned"))
        .def("payload", &BlockIndex::payload, nb::sig("def payload(self, slot: int, /) -> object | None"))
        .def("payloads", &BlockIndex::payloads, nb::sig("def payloads(self, ids: " IDS ", /) -> list[object]"))
        .def("items", &BlockIndex::items, nb::sig("def items(self) -> list[tuple[int, object]]"))
        .def("state", &BlockIndex::state, nb::sig("def state(self, slot: int, /) -> int"))
        .def("free_count", &BlockIndex::free_count)
        .def("inflight_count", &BlockIndex::inflight_count)
        .def("pinned_count", &BlockIndex::pinned_count)
        .def("orphan_count", &BlockIndex::orphan_count)
        .def("set_free", &BlockIndex::set_free, nb::sig("def set_free(self, slots: " SLOTS ", /) -> None"))
        .def("add_free", &BlockIndex::add_free, nb::sig("def add_free(self, slots: " SLOTS ", /) -> None"));
    m.def("held_by", &held_by, nb::arg("ids"), nb::arg("indexes"), nb::arg("touch") = false,
          nb::sig("def held_by(ids: " IDS ", indexes: collections.abc.Sequence[BlockIndex], touch: bool = False) "
                  "-> bytes"),
          "Per id of the leading run held by any index, a byte whose bit i says indexes[i] registers it; "
          "``touch``: indexes[0]'s blocks of that run are made most recently used, the first most, and "
          "indexes[0] remembers the run: a call given the same ids next (a load's ``pin``, the offload's "
          "``reserve_missing``; the same objects or equal ones) skips their probes.");
    kvbm::bind_pages(m);
}
