// BlockIndex: which slot of one tier holds which block, compiled (``sglang_kvbm._blocks``).
//
// One per tier (host rows, staging rows, disk slots). Everything the scheduler
// thread asks of a tier about a node's pages is one call here: the leading run
// held, which pages are missing, reserve/commit/abort a copy's slots, pin/unpin
// a load's rows, touch a prefix, evict least recently used blocks.
//
// * Block ids arrive as SGLang hands them (64-character hex sha256 strings) or
//   as 32 raw bytes; inside they are 32 raw bytes, never a Python object.
// * Per slot: its key, its lifecycle state (KVBM's FREE -> MUTABLE ->
//   REGISTERED -> FREE; see ``core/lifecycle.py``), pin count, the holders of
//   an orphan (a slot a copy still uses after the tier forgot its block),
//   intrusive LRU links, and one Python object the tier keeps beside it (the
//   host's BlockMeta, the disk's header).
// * An open-addressing table (linear probing, backward-shift deletion, load
//   <= 1/2) maps key -> slot for blocks registered or being written.
//
// Scheduler thread only, called with the GIL held (each call is a few
// microseconds at most: releasing the GIL would cost more than it saves).

#include <nanobind/nanobind.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <vector>

#include "block_ids.h"
#include "key_table.h"
#include "py_seq.h"

namespace {

using namespace kvbm;

enum State : uint8_t { FREE = 0, MUTABLE = 1, COMMITTED = 2, REGISTERED = 3 };
const char *const STATE_NAMES[] = {"FREE", "MUTABLE", "COMMITTED", "REGISTERED"};

struct BlockStateError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

class BlockIndex {
  public:
    // ``all_free``: every slot usable and free (host rows); else none until ``set_free``/``restore`` (disk).
    BlockIndex(int32_t capacity, bool all_free)
        : cap_(check_capacity(capacity)), keys_(capacity), state_(capacity, FREE), mapped_(capacity, 0),
          usable_(capacity, all_free), pins_(capacity, 0), orphan_(capacity, 0), payload_(capacity), table_(capacity),
          lru_(capacity) {
        if (all_free) {
            free_.reserve(capacity);
            for (int32_t s = capacity - 1; s >= 0; --s) free_.push_back(s);  // popped from the end: ascending
        }
    }

    int32_t capacity() const { return cap_; }
    size_t size() const { return registered_; }

    // -- membership, one call per node ------------------------------------------------

    bool holds(nb::handle id) const { return find(parse(id.ptr())) >= 0; }

    bool registered(nb::handle id) const {
        int32_t s = find(parse(id.ptr()));
        return s >= 0 && state_[s] == REGISTERED;
    }

    nb::object slot(nb::handle id) const {
        int32_t s = find(parse(id.ptr()));
        return s >= 0 && state_[s] == REGISTERED ? nb::object(nb::int_(s)) : nb::object(nb::none());
    }

    // Registered: the slot; else None.
    nb::list slots(nb::handle ids) const {
        Items it(ids);
        nb::list out;
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            out.append(s >= 0 && state_[s] == REGISTERED ? nb::object(nb::int_(s)) : nb::object(nb::none()));
        }
        return out;
    }

    // Leading ids registered here.
    Py_ssize_t run(nb::handle ids) const {
        Items it(ids);
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            if (s < 0 || state_[s] != REGISTERED) return i;
        }
        return it.n;
    }

    // Positions of ids neither registered nor being written here.
    nb::list missing(nb::handle ids) const {
        Items it(ids);
        std::vector<int32_t> out;
        for (Py_ssize_t i = 0; i < it.n; ++i)
            if (find(parse(it.items[i])) < 0) out.push_back(int32_t(i));
        return int_list(out.data(), out.size());
    }

    // Per id, one byte: 1 registered here, else 0.
    nb::bytes flags(nb::handle ids) const {
        Items it(ids);
        std::string out(size_t(it.n), '\0');
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            out[size_t(i)] = char(s >= 0 && state_[s] == REGISTERED);
        }
        return nb::bytes(out.data(), out.size());
    }

    // -- a copy's slots: reserve -> commit, or abort ------------------------------------

    // A slot for each leading id that finds one (evicting least recently used unpinned blocks);
    // returns (slots, payloads of the blocks evicted). Ids must not be held here already.
    nb::tuple reserve(nb::handle ids) {
        Items it(ids);
        std::vector<Key> keys(it.n);
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            keys[i] = parse(it.items[i]);
            if (find(keys[i]) >= 0) throw BlockStateError("reserve: block " + hex(keys[i]) + " is held already");
        }
        nb::list evicted;
        size_t need = size_t(it.n);
        if (free_.size() < need) evict(need - free_.size(), evicted);
        size_t take = std::min(need, free_.size());
        std::vector<int32_t> got(take);
        for (size_t i = 0; i < take; ++i) {
            int32_t s = free_.back();
            if (state_[s] != FREE || find(keys[i]) >= 0) {  // a caller's bug: undo this call, then say so
                std::string why = state_[s] != FREE ? move_error(s, MUTABLE, FREE)
                                                    : "reserve: block " + hex(keys[i]) + " appears twice";
                for (size_t j = i; j-- > 0;) {
                    erase(got[j]);
                    state_[got[j]] = FREE;
                    free_.push_back(got[j]);
                }
                throw BlockStateError(why);
            }
            free_.pop_back();
            keys_[s] = keys[i];
            state_[s] = MUTABLE;
            insert(s);
            got[i] = s;
        }
        inflight_ += take;
        return nb::make_tuple(int_list(got.data(), take), evicted);
    }

    // The slots hold their blocks' bytes: register them, the first most recent (a prefix's tail evicts first).
    void commit(nb::handle slot_seq, nb::handle payloads) {
        std::vector<int32_t> slots = ints(slot_seq, cap_);
        Items p(payloads);
        if (size_t(p.n) != slots.size()) throw nb::value_error("commit: one payload per slot");
        for (int32_t s : slots)
            if (state_[s] != MUTABLE || orphan_[s] || !mapped_[s]) throw BlockStateError(move_error(s, REGISTERED, MUTABLE));
        for (size_t i = slots.size(); i-- > 0;) {
            int32_t s = slots[i];
            state_[s] = REGISTERED;
            payload_[s] = nb::borrow(p.items[i]);
            link_mru(s);
        }
        inflight_ -= slots.size();
        registered_ += slots.size();
    }

    // Blocks found at start-up, least recently used first, into FREE slots.
    void restore(nb::handle slot_seq, nb::handle ids, nb::handle payloads) {
        std::vector<int32_t> slots = ints(slot_seq, cap_);
        Items k(ids), p(payloads);
        if (size_t(k.n) != slots.size() || size_t(p.n) != slots.size())
            throw nb::value_error("restore: one id and one payload per slot");
        for (size_t i = 0; i < slots.size(); ++i) {
            int32_t s = slots[i];
            if (state_[s] != FREE) throw BlockStateError(move_error(s, REGISTERED, FREE));
            Key key = parse(k.items[i]);
            if (find(key) >= 0) throw BlockStateError("restore: block " + hex(key) + " is held already");
            keys_[s] = key;
            state_[s] = REGISTERED;
            usable_[s] = 1;
            insert(s);
            payload_[s] = nb::borrow(p.items[i]);
            link_mru(s);
            ++registered_;
        }
        drop_from_free(slots);
    }

    // A copy failed or was discarded: its slots go back (an orphan's: once its last holder let go).
    // Slots no longer being written (registered since, or freed) are left alone.
    void abort(nb::handle slot_seq) {
        for (int32_t s : ints(slot_seq, cap_)) {
            if (orphan_[s]) {
                release_orphan(s);
            } else if (state_[s] == MUTABLE) {
                if (mapped_[s]) erase(s);
                --inflight_;
                release(s);
            }
        }
    }

    // A copy that started before ``forget`` ended: it gives back its hold on each slot.
    void release_orphans(nb::handle slot_seq) {
        if (!orphans_) return;
        for (int32_t s : ints(slot_seq, cap_))
            if (orphan_[s]) release_orphan(s);
    }

    // -- reads of registered blocks --------------------------------------------------------

    // Make these blocks most recently used, the first one last (a prefix's head outlives its tail).
    void touch(nb::handle ids) {
        Items it(ids);
        for (Py_ssize_t i = it.n; i-- > 0;) {
            int32_t s = find(parse(it.items[i]));
            if (s >= 0 && state_[s] == REGISTERED) {
                unlink(s);
                link_mru(s);
            }
        }
    }

    // Keep blocks from eviction while their slots are read; returns the slots. Every id must be registered.
    nb::list pin(nb::handle ids) {
        Items it(ids);
        std::vector<int32_t> got(it.n);
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            if (s < 0 || state_[s] != REGISTERED) throw nb::key_error(nb::str(nb::handle(it.items[i])).c_str());
            got[i] = s;
        }
        for (int32_t s : got)
            if (pins_[s]++ == 0) ++pinned_;
        return int_list(got.data(), got.size());
    }

    // Undo one ``pin`` of each id (ids not pinned are ignored; a repeated id is two unpins).
    void unpin(nb::handle ids) {
        Items it(ids);
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            if (s >= 0 && state_[s] == REGISTERED && pins_[s] > 0 && --pins_[s] == 0) --pinned_;
        }
    }

    bool pinned(nb::handle id) const { return pins(id) > 0; }

    int32_t pins(nb::handle id) const {
        int32_t s = find(parse(id.ptr()));
        return s >= 0 && state_[s] == REGISTERED ? pins_[s] : 0;
    }

    // -- dropping blocks -----------------------------------------------------------------

    // Forget registered blocks (``skip_pinned``: not those in use); returns their payloads.
    nb::list remove(nb::handle ids, bool skip_pinned) {
        Items it(ids);
        std::vector<int32_t> found;
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            if (s >= 0 && state_[s] == REGISTERED && !(skip_pinned && pins_[s])) found.push_back(s);
        }
        nb::list out;
        for (int32_t s : found)
            if (state_[s] == REGISTERED) out.append(drop_registered(s));  // (an id repeated in ``ids``: once)
        return out;
    }

    // These slots are gone (their segment file): drop their registered blocks and never hand them out again.
    nb::list drop_slots(nb::handle slot_seq) {
        std::vector<int32_t> slots = ints(slot_seq, cap_);
        nb::list out;
        for (int32_t s : slots) {
            usable_[s] = 0;
            if (state_[s] == REGISTERED && !orphan_[s]) out.append(drop_registered(s));
        }
        drop_from_free(slots);
        return out;
    }

    // Drop every block. ``keep_pinned``: a pinned block's slot becomes an orphan its holders release
    // (host rows a copy reads); else it is freed (disk slots: their reads check the generation).
    // Slots being written become orphans of their writer. Returns the slots freed.
    nb::list forget(bool keep_pinned) {
        std::vector<int32_t> freed;
        for (int32_t s = lru_.head(); s >= 0;) {
            int32_t nx = lru_.next(s);
            payload_[s] = nb::object();
            if (keep_pinned && pins_[s]) {
                orphan_[s] = pins_[s];
                ++orphans_;
            } else {
                state_[s] = FREE;
                freed.push_back(s);
                if (usable_[s]) free_.push_back(s);
            }
            pins_[s] = 0;
            s = nx;
        }
        for (int32_t s = 0; s < cap_; ++s)
            if (mapped_[s] && state_[s] == MUTABLE) {
                orphan_[s] = 1;
                ++orphans_;
            }
        table_.clear();
        lru_.clear();
        std::fill(mapped_.begin(), mapped_.end(), 0);
        registered_ = inflight_ = pinned_ = 0;
        return int_list(freed.data(), freed.size());
    }

    // -- what is kept ------------------------------------------------------------------------

    nb::object payload(int32_t s) const {
        check(s);
        return payload_[s].is_valid() ? payload_[s] : nb::none();
    }

    // The payloads of those ids that are registered, in order.
    nb::list payloads(nb::handle ids) const {
        Items it(ids);
        nb::list out;
        for (Py_ssize_t i = 0; i < it.n; ++i) {
            int32_t s = find(parse(it.items[i]));
            if (s >= 0 && state_[s] == REGISTERED) out.append(payload_[s]);
        }
        return out;
    }

    // (slot, payload) of every registered block, least recently used first.
    nb::list items() const {
        nb::list out;
        for (int32_t s = lru_.head(); s >= 0; s = lru_.next(s)) out.append(nb::make_tuple(s, payload(s)));
        return out;
    }

    int state(int32_t s) const {
        check(s);
        return state_[s];
    }

    // -- where the slots are (``/stats``, the soak test's bookkeeping) ----------------------------

    size_t free_count() const { return free_.size(); }
    size_t inflight_count() const { return inflight_; }
    size_t pinned_count() const { return pinned_; }
    size_t orphan_count() const { return orphans_; }

    void set_free(nb::handle slot_seq) {
        std::vector<int32_t> slots = ints(slot_seq, cap_);
        std::sort(slots.begin(), slots.end(), std::greater<int32_t>());
        free_.clear();
        for (int32_t s : slots) {
            if (state_[s] != FREE) throw BlockStateError("set_free: slot " + std::to_string(s) + " is in use");
            usable_[s] = 1;
            free_.push_back(s);
        }
    }

    void add_free(nb::handle slot_seq) {
        for (int32_t s : ints(slot_seq, cap_)) {
            usable_[s] = 1;
            if (state_[s] == FREE) free_.push_back(s);
        }
    }

    // The slot of a registered key, or -1 (``held_by``: one parse per id for every index).
    int32_t registered_slot(const Key &k) const {
        int32_t s = find(k);
        return s >= 0 && state_[s] == REGISTERED ? s : -1;
    }

  private:
    int32_t cap_;
    std::vector<Key> keys_;
    std::vector<uint8_t> state_, mapped_, usable_;
    std::vector<int32_t> pins_, orphan_, free_;
    std::vector<nb::object> payload_;
    KeyTable table_;  // key -> slot, for blocks registered or being written
    LruLinks lru_;    // registered slots
    size_t registered_ = 0, inflight_ = 0, pinned_ = 0, orphans_ = 0;

    static int32_t check_capacity(int32_t capacity) {
        if (capacity < 0) throw nb::value_error("capacity must be >= 0");
        return capacity;
    }

    int32_t find(const Key &k) const { return table_.find(k, keys_); }

    void insert(int32_t s) {
        table_.insert(s, keys_);
        mapped_[s] = 1;
    }

    void erase(int32_t s) {
        table_.erase(s, keys_);
        mapped_[s] = 0;
    }

    void link_mru(int32_t s) { lru_.push_back(s); }
    void unlink(int32_t s) { lru_.unlink(s); }

    void release(int32_t s) {
        state_[s] = FREE;
        payload_[s] = nb::object();
        if (usable_[s]) free_.push_back(s);
    }

    void release_orphan(int32_t s) {
        if (--orphan_[s] == 0) {
            --orphans_;
            release(s);
        }
    }

    nb::object drop_registered(int32_t s) {
        nb::object p = payload_[s].is_valid() ? payload_[s] : nb::none();
        unlink(s);
        erase(s);
        if (pins_[s]) {
            pins_[s] = 0;
            --pinned_;
        }
        --registered_;
        release(s);
        return p;
    }

    // Up to n least recently used unpinned blocks leave; a pinned block met on the way is made most recent
    // (so a search walks it at most once per pin); every block pinned: nothing is walked.
    void evict(size_t n, nb::list &out) {
        size_t got = 0, walked = 0;
        while (got < n && pinned_ < registered_ && walked < registered_) {
            int32_t s = lru_.head();
            if (pins_[s]) {
                unlink(s);
                link_mru(s);
                ++walked;
                continue;
            }
            out.append(drop_registered(s));
            ++got;
        }
    }

    void drop_from_free(const std::vector<int32_t> &slots) {
        std::vector<uint8_t> gone(cap_, 0);
        for (int32_t s : slots) gone[s] = 1;
        std::vector<int32_t> kept;
        kept.reserve(free_.size());
        for (int32_t s : free_)
            if (!gone[s]) kept.push_back(s);
        free_.swap(kept);
    }

    void check(int32_t s) const {
        if (s < 0 || s >= cap_) throw nb::index_error(("slot " + std::to_string(s) + " out of range").c_str());
    }

    std::string move_error(int32_t s, State to, State from) const {
        return "slot " + std::to_string(s) + ": cannot go " + (orphan_[s] ? "ORPHANED" : STATE_NAMES[state_[s]]) +
               " -> " + STATE_NAMES[to] + " (only from " + STATE_NAMES[from] + ")";
    }
};

// Per id of the leading run held by any of ``indexes``: a byte whose bit i says indexes[i] registers it.
// The run ends at the first id none of them holds (the chain's lookups stop there).
nb::bytes held_by(nb::handle ids, nb::handle index_seq) {
    Items given(index_seq);
    if (given.n > 8) throw nb::value_error("held_by: at most 8 indexes");
    std::vector<const BlockIndex *> indexes;
    for (Py_ssize_t t = 0; t < given.n; ++t) indexes.push_back(nb::cast<const BlockIndex *>(nb::handle(given.items[t])));
    Items it(ids);
    std::string out;
    out.reserve(size_t(it.n));
    for (Py_ssize_t i = 0; i < it.n; ++i) {
        Key key = parse(it.items[i]);
        uint8_t mask = 0;
        for (size_t t = 0; t < indexes.size(); ++t)
            if (indexes[t]->registered_slot(key) >= 0) mask |= uint8_t(1u << t);
        if (!mask) break;
        out.push_back(char(mask));
    }
    return nb::bytes(out.data(), out.size());
}

}  // namespace

NB_MODULE(_blocks, m) {
    m.doc() = "The compiled block index of each tier (see csrc/block_index.cpp).";
    // An index lives as long as its tier; at interpreter exit some still do (daemon copy threads hold theirs).
    nb::set_leak_warnings(false);
    nb::exception<BlockStateError>(m, "BlockStateError", PyExc_RuntimeError);
    nb::class_<BlockIndex>(m, "BlockIndex")
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
        .def("pinned", &BlockIndex::pinned)
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
