// BlockIndex's calls (see block_index.h; the primitives they are built from: block_state.cpp). Each
// state-changing call has three phases: read the batch (the only phase that may run Python code:
// ``__index__``, or a ``__repr__`` for an error), check all of it against the state, then change the
// state. Payloads let go are moved out and released at return.

#include "block_index.h"

#include <algorithm>
#include <functional>

namespace kvbm {

namespace {
int32_t check_capacity(int32_t capacity) {
    if (capacity < 0) throw nb::value_error("capacity must be >= 0");
    return capacity;
}
}  // namespace

BlockIndex::BlockIndex(int32_t capacity, bool all_free)
    : cap_(check_capacity(capacity)), keys_(size_t(capacity)), state_(size_t(capacity), FREE),
      mapped_(size_t(capacity), 0), usable_(size_t(capacity), all_free), seen_(size_t(capacity), 0),
      pins_(size_t(capacity), 0), orphan_(size_t(capacity), 0), payload_(size_t(capacity)), free_(capacity),
      table_(capacity), lru_(capacity) {
    if (all_free) {
        free_.reserve(size_t(capacity));
        for (int32_t s = capacity - 1; s >= 0; --s) free_.push(s);  // taken from the end: ascending
    }
}

// -- membership ----------------------------------------------------------------------------------

nb::object BlockIndex::slot(nb::handle id) const {
    int32_t s = registered_slot(parse(id.ptr()));
    return s >= 0 ? nb::object(nb::int_(s)) : nb::object(nb::none());
}

nb::list BlockIndex::slots(nb::handle ids) const {
    Items it(ids);
    Slots found;
    found.reserve(size_t(it.n));
    each_slot(it, true, [&](Py_ssize_t, int32_t s, const Key &) { found.push_back(s); return true; });
    nb::list out;  // built after every id was read: building runs no Python code, but reading may raise
    for (int32_t s : found) out.append(s >= 0 ? nb::object(nb::int_(s)) : nb::object(nb::none()));
    return out;
}

Py_ssize_t BlockIndex::run(nb::handle ids) const {
    Items it(ids);
    Py_ssize_t held = it.n;
    each_slot(it, true, [&](Py_ssize_t i, int32_t s, const Key &) { return s >= 0 || (held = i, false); });
    return held;
}

nb::list BlockIndex::missing(nb::handle ids) const {
    Items it(ids);
    Slots out;
    each_slot(it, false, [&](Py_ssize_t i, int32_t s, const Key &) {
        if (s < 0) out.push_back(int32_t(i));
        return true;
    });
    return int_list(out.data(), out.size());
}

nb::bytes BlockIndex::flags(nb::handle ids) const {
    Items it(ids);
    std::string out(size_t(it.n), '\0');
    each_slot(it, true, [&](Py_ssize_t i, int32_t s, const Key &) { return out[size_t(i)] = char(s >= 0), true; });
    return nb::bytes(out.data(), out.size());
}

// -- a copy's slots ----------------------------------------------------------------------------------

// A slot for each leading id that finds one (evicting least recently used unpinned blocks); returns
// (slots, payloads of the blocks evicted). The ids must be distinct and not held here already.
nb::tuple BlockIndex::reserve(nb::handle ids) {
    Keys keys;
    keys_of(ids, keys);
    ids_once(keys, "reserve");
    not_held(keys, "reserve");
    nb::list evicted;
    Slots got;
    take_slots(keys, got, evicted);
    return nb::make_tuple(int_list(got.data(), got.size()), evicted);
}

// ``missing`` and ``reserve`` of those ids in one call (an offload's first tier): (positions of the ids
// neither registered nor being written, slots for the leading ones of them, payloads evicted). The ids not
// held must be distinct.
nb::tuple BlockIndex::reserve_missing(nb::handle ids) {
    refuse_one_id(ids);
    Items it(ids);
    Slots todo, known;
    known.resize(size_t(it.n));
    Keys keys;
    each_slot(  // the leading ids its lookup found registered are held: no probe for those
        it, false,
        [&](Py_ssize_t i, int32_t s, const Key &k) {
            if (s < 0) {
                todo.push_back(int32_t(i));
                keys.push_back(k);
            }
            return true;
        },
        recall(it, known.data()));
    ids_once(keys, "reserve_missing");
    nb::list evicted;
    Slots got;
    take_slots(keys, got, evicted);
    return nb::make_tuple(int_list(todo.data(), todo.size()), int_list(got.data(), got.size()), evicted);
}

// Slots for the leading keys that find one (checked: distinct, not held), evicting into ``evicted``.
void BlockIndex::take_slots(const Keys &keys, Slots &got, nb::list &evicted) {
    size_t need = keys.size();
    if (free_.size() < need) evict(need - free_.size(), evicted);
    size_t take = std::min(need, free_.size());
    for (size_t i = 0; i < take; ++i) {
        int32_t s = free_.pop();
        if (state_[size_t(s)] != FREE || orphan_[size_t(s)] || !usable_[size_t(s)]) corrupted("a listed slot in use");
        state_[size_t(s)] = MUTABLE;
        map(s, keys[i]);
        got.push_back(s);
    }
    inflight_ += take;
}

// The slots hold their blocks' bytes: register them, the first most recent (a prefix's tail evicts first).
void BlockIndex::commit(nb::handle slot_seq, nb::handle payloads) {
    Slots slots;
    distinct_slots(slot_seq, slots, "commit");
    Items p(payloads);  // after the slots: reading those may run Python code
    if (size_t(p.n) != slots.size()) throw nb::value_error("commit: one payload per slot");
    for (int32_t s : slots)
        if (state_[size_t(s)] != MUTABLE || orphan_[size_t(s)] || !mapped_[size_t(s)])
            throw BlockStateError(move_error(s, REGISTERED, MUTABLE));
    for (size_t i = slots.size(); i-- > 0;) {
        int32_t s = slots[i];
        state_[size_t(s)] = REGISTERED;
        payload_[size_t(s)] = nb::borrow(p.items[i]);
        lru_.push_back(s);
    }
    inflight_ -= slots.size();
    registered_ += slots.size();
}

// Blocks found at start-up, least recently used first, into FREE slots.
void BlockIndex::restore(nb::handle slot_seq, nb::handle ids, nb::handle payloads) {
    Slots slots;
    distinct_slots(slot_seq, slots, "restore");
    Keys keys;
    keys_of(ids, keys);
    Items p(payloads);
    if (keys.size() != slots.size() || size_t(p.n) != slots.size())
        throw nb::value_error("restore: one id and one payload per slot");
    ids_once(keys, "restore");
    for (int32_t s : slots) expect_state(s, FREE, REGISTERED);
    not_held(keys, "restore");
    for (size_t i = 0; i < slots.size(); ++i) {
        int32_t s = slots[i];
        state_[size_t(s)] = REGISTERED;
        usable_[size_t(s)] = 1;
        map(s, keys[i]);
        payload_[size_t(s)] = nb::borrow(p.items[i]);
        lru_.push_back(s);
    }
    registered_ += slots.size();
    free_.remove(slots);
}

// A copy failed or was discarded: its slots go back (an orphan's: once its last holder let go).
// Slots no longer being written (registered since, or freed) are left alone.
void BlockIndex::abort(nb::handle slot_seq) {
    Slots slots;
    distinct_slots(slot_seq, slots, "abort");
    for (int32_t s : slots) {
        if (orphan_[size_t(s)]) {
            release_orphan(s);
        } else if (state_[size_t(s)] == MUTABLE) {
            unmap(s);
            --inflight_;
            release(s);
        }
    }
}

// A copy that started before ``forget`` ended: it gives back its hold on each slot (a slot listed twice:
// two holds, as a row pinned twice).
void BlockIndex::release_orphans(nb::handle slot_seq) {
    Slots slots;
    slots_of(slot_seq, cap_, slots);
    if (!orphans_) return;
    for (int32_t s : slots)
        if (orphan_[size_t(s)]) release_orphan(s);
}

// -- reads of registered blocks ------------------------------------------------------------------------

// Make these blocks most recently used, the first one last (a prefix's head outlives its tail). Ids not
// registered are skipped; a malformed id anywhere refuses the whole call.
void BlockIndex::touch(nb::handle ids) {
    Slots found;
    registered_slots(ids, found);
    touch_slots(found);
}

void BlockIndex::remember(const Key *keys, const int32_t *slots, Py_ssize_t n) {
    recent_keys_.assign(keys, keys + n);
    recent_slots_.assign(slots, slots + n);
}

void BlockIndex::touch_slots(const Slots &found) {
    for (size_t i = found.size(); i-- > 0;)
        if (found[i] >= 0) {
            lru_.unlink(found[i]);
            lru_.push_back(found[i]);
        }
}

// Keep blocks from eviction while their slots are read; returns the slots. Every id must be registered
// (else KeyError, nothing pinned); a repeated id is two pins.
nb::object BlockIndex::pin(nb::handle ids) {
    Slots found;
    Py_ssize_t missing = registered_slots(ids, found);
    if (missing >= 0) {
        Items it(ids);
        throw nb::key_error(hex(parse(it.items[missing])).c_str());
    }
    for (int32_t s : found)
        if (pins_[size_t(s)]++ == 0) ++pinned_;
    return int32_array(found.data(), found.size());
}

// Undo one ``pin`` of each id (ids not pinned are ignored; a repeated id is two unpins).
void BlockIndex::unpin(nb::handle ids) {
    Slots found;
    registered_slots(ids, found);
    for (int32_t s : found)
        if (s >= 0 && pins_[size_t(s)] > 0 && --pins_[size_t(s)] == 0) --pinned_;
}

// ``unpin`` by the slots ``pin`` returned (no id looked up again): a slot still registered and pinned loses
// one pin; others (dropped since: an orphan, or freed) are left alone. A repeated slot is two unpins. Only
// for a tier that never frees a pinned slot while its pin is held (host rows: ``remove`` skips pinned
// blocks, eviction too, ``forget`` orphans them), so the slot is the block that was pinned.
void BlockIndex::unpin_slots(nb::handle slot_seq) {
    Slots slots;
    slots_of(slot_seq, cap_, slots);
    for (int32_t s : slots)
        if (state_[size_t(s)] == REGISTERED && !orphan_[size_t(s)] && pins_[size_t(s)] > 0 && --pins_[size_t(s)] == 0)
            --pinned_;
}

int32_t BlockIndex::pins(nb::handle id) const {
    int32_t s = registered_slot(parse(id.ptr()));
    return s >= 0 ? pins_[size_t(s)] : 0;
}

// -- dropping blocks ----------------------------------------------------------------------------------

// Forget registered blocks (``skip_pinned``: not those in use); returns their payloads (an id repeated: once).
nb::list BlockIndex::remove(nb::handle ids, bool skip_pinned) {
    Slots found;
    registered_slots(ids, found);
    nb::list out;
    for (int32_t s : found)  // (a repeated id: its slot is FREE the second time)
        if (s >= 0 && state_[size_t(s)] == REGISTERED && !(skip_pinned && pins_[size_t(s)]))
            out.append(drop_registered(s));
    return out;
}

// These slots are gone (their segment file): drop their registered blocks and never hand them out again.
nb::list BlockIndex::drop_slots(nb::handle slot_seq) {
    Slots slots;
    distinct_slots(slot_seq, slots, "drop_slots");
    nb::list out;
    for (int32_t s : slots) {
        usable_[size_t(s)] = 0;
        if (state_[size_t(s)] == REGISTERED && !orphan_[size_t(s)]) out.append(drop_registered(s));
    }
    free_.remove(slots);
    return out;
}

// Drop every block. ``keep_pinned``: a pinned block's slot becomes an orphan its holders release
// (host rows a copy reads); else it is freed (disk slots: their reads check the generation).
// Slots being written become orphans of their writer. Returns the slots freed.
nb::list BlockIndex::forget(bool keep_pinned) {
    std::vector<nb::object> dropped;  // released at return, when the index is whole again
    dropped.reserve(registered_);
    Slots freed;
    for (int32_t s = lru_.head(); s >= 0;) {
        int32_t nx = lru_.next(s);
        dropped.push_back(std::move(payload_[size_t(s)]));
        if (keep_pinned && pins_[size_t(s)]) {
            orphan_[size_t(s)] = pins_[size_t(s)];
            ++orphans_;
        } else {
            state_[size_t(s)] = FREE;
            freed.push_back(s);
            if (usable_[size_t(s)]) free_.push(s);
        }
        pins_[size_t(s)] = 0;
        s = nx;
    }
    for (int32_t s = 0; s < cap_; ++s)
        if (mapped_[size_t(s)] && state_[size_t(s)] == MUTABLE) {
            orphan_[size_t(s)] = 1;
            ++orphans_;
        }
    table_.clear();
    lru_.clear();
    std::fill(mapped_.begin(), mapped_.end(), 0);
    registered_ = inflight_ = pinned_ = 0;
    return int_list(freed.data(), freed.size());
}

// -- what is kept ----------------------------------------------------------------------------------------

nb::object BlockIndex::payload(int32_t s) const {
    check(s);
    return payload_[size_t(s)].is_valid() ? payload_[size_t(s)] : nb::none();
}

// The payloads of those ids that are registered, in order.
nb::list BlockIndex::payloads(nb::handle ids) const {
    Items it(ids);
    Slots found;
    found.resize(size_t(it.n));
    found.resize(size_t(recall(it, found.data())));
    each_slot(
        it, true,
        [&](Py_ssize_t, int32_t s, const Key &) {
            if (s >= 0) found.push_back(s);
            return true;
        },
        Py_ssize_t(found.size()));
    nb::list out;
    for (int32_t s : found) out.append(payload(s));
    return out;
}

// (slot, payload) of every registered block, least recently used first.
nb::list BlockIndex::items() const {
    nb::list out;
    for (int32_t s = lru_.head(); s >= 0; s = lru_.next(s)) out.append(nb::make_tuple(s, payload(s)));
    return out;
}

int BlockIndex::state(int32_t s) const {
    check(s);
    return state_[size_t(s)];
}

// -- where the slots are ------------------------------------------------------------------------------

// These slots, and only these, are free (a disk's slots at start-up); each must be FREE.
void BlockIndex::set_free(nb::handle slot_seq) {
    Slots slots;
    distinct_slots(slot_seq, slots, "set_free");
    for (int32_t s : slots)
        if (state_[size_t(s)] != FREE) throw BlockStateError("set_free: slot " + std::to_string(s) + " is in use");
    std::vector<int32_t> order(slots.begin(), slots.end());
    std::sort(order.begin(), order.end(), std::greater<int32_t>());  // taken from the end: ascending
    free_.clear();
    for (int32_t s : order) {
        usable_[size_t(s)] = 1;
        free_.push(s);
    }
}

// These slots are usable (again): those FREE join the free list (once).
void BlockIndex::add_free(nb::handle slot_seq) {
    Slots slots;
    distinct_slots(slot_seq, slots, "add_free");
    for (int32_t s : slots) {
        usable_[size_t(s)] = 1;
        if (state_[size_t(s)] == FREE && !orphan_[size_t(s)]) free_.push(s);
    }
}

}  // namespace kvbm
