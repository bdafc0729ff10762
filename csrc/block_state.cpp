// BlockIndex's primitives (see block_index.h): how a slot moves, the batch checks every call makes before it
// changes anything, and the garbage collector's view of the payloads.

#include "block_index.h"

namespace kvbm {

namespace {
const char *const STATE_NAMES[] = {"FREE", "MUTABLE", "COMMITTED", "REGISTERED"};
}  // namespace

// -- garbage collection ---------------------------------------------------------------------------------

int BlockIndex::traverse(visitproc visit, void *arg) const {
    for (const nb::object &p : payload_)
        if (p.is_valid()) {
            int r = visit(p.ptr(), arg);
            if (r) return r;
        }
    return 0;
}

void BlockIndex::clear_payloads() {
    std::vector<nb::object> dropped;  // released after the loop: a __del__ may call back in
    for (nb::object &p : payload_)
        if (p.is_valid()) dropped.push_back(std::move(p));
}

// -- private -------------------------------------------------------------------------------------------

// Per id, its registered slot or -1 (every id read, so a malformed one refuses the call before it changes
// anything); returns the position of the first id not registered, or -1.
Py_ssize_t BlockIndex::registered_slots(nb::handle ids, Slots &out) const {
    refuse_one_id(ids);
    Items it(ids);
    out.resize(size_t(it.n));
    int32_t *slot = out.data();
    Py_ssize_t first_missing = -1;
    each_slot(
        it, true,
        [&](Py_ssize_t i, int32_t s, const Key &) {
            slot[i] = s;
            if (s < 0 && first_missing < 0) first_missing = i;
            return true;
        },
        recall(it, slot));
    return first_missing;
}

void BlockIndex::find_group(const Key *keys, const bool *ok, Py_ssize_t n, bool registered, int32_t *out,
                            int32_t &after) const {
    // The slot after the previous key's: a slot holds at most one key, the table maps each key it holds, so a
    // mapped slot holding this key is the one the table would find. Where that misses after a key found (a
    // run's edge), or for a batch's first key (``FIRST_OF_BATCH``), the key is probed at once and the guesses
    // go on from its slot; a second miss in a row leaves the rest of the group to the overlapped probes below
    // (rows in no order cost one lone probe a group more than none; keys not held, none).
    constexpr int32_t PROBE = -2;
    bool probe = false, alone = after >= 0 || after == FIRST_OF_BATCH;  // alone: the next miss is probed at once
    int32_t prev = after >= 0 ? after : -1;
    for (Py_ssize_t j = 0; j < n; ++j) {
        const int32_t g = prev >= 0 && prev + 1 < cap_ ? prev + 1 : -1;
        if (!ok[j]) {
            out[j] = prev = -1;
        } else if (g >= 0 && mapped_[size_t(g)] && keys_[size_t(g)] == keys[j]) {
            out[j] = prev = g;
            alone = true;
        } else if (alone) {
            out[j] = prev = find(keys[j]);
            alone = false;
        } else {
            out[j] = PROBE;
            probe = true;
            prev = -1;
        }
    }
    if (probe) {
        size_t cell[IdGroup::N];
        for (Py_ssize_t j = 0; j < n; ++j)
            if (out[j] == PROBE) {
                cell[j] = table_.home(keys[j]);
                table_.prefetch(cell[j]);
            }
        for (Py_ssize_t j = 0; j < n; ++j)
            if (out[j] == PROBE) {
                int32_t s = table_.first(cell[j]);
                if (s >= 0) {
                    KVBM_PREFETCH(&keys_[size_t(s)]);
                    KVBM_PREFETCH(&state_[size_t(s)]);
                }
            }
        for (Py_ssize_t j = 0; j < n; ++j)
            if (out[j] == PROBE) out[j] = table_.find_from(cell[j], keys[j], keys_);
    }
    if (n) after = out[n - 1];
    if (registered)
        for (Py_ssize_t j = 0; j < n; ++j)
            if (out[j] >= 0 && state_[size_t(out[j])] != REGISTERED) out[j] = -1;
}

void BlockIndex::map(int32_t s, const Key &k) {
    keys_[size_t(s)] = k;
    table_.insert(s, keys_);
    mapped_[size_t(s)] = 1;
}

void BlockIndex::unmap(int32_t s) {
    if (!mapped_[size_t(s)]) return;
    table_.erase(s, keys_);
    mapped_[size_t(s)] = 0;
}

// The slot is free; its payload was moved out before.
void BlockIndex::release(int32_t s) {
    state_[size_t(s)] = FREE;
    if (usable_[size_t(s)]) free_.push(s);
}

void BlockIndex::release_orphan(int32_t s) {
    if (--orphan_[size_t(s)] == 0) {
        --orphans_;
        release(s);
    }
}

nb::object BlockIndex::drop_registered(int32_t s) {
    nb::object p = payload_[size_t(s)].is_valid() ? std::move(payload_[size_t(s)]) : nb::none();
    lru_.unlink(s);
    unmap(s);
    if (pins_[size_t(s)]) {
        pins_[size_t(s)] = 0;
        --pinned_;
    }
    --registered_;
    release(s);
    return p;
}

// Up to n least recently used unpinned blocks leave; a pinned block met on the way is made most recent
// (so a search walks it at most once per pin); every block pinned: nothing is walked.
void BlockIndex::evict(size_t n, nb::list &out) {
    size_t got = 0, walked = 0;
    while (got < n && pinned_ < registered_ && walked < registered_) {
        int32_t s = lru_.head();
        if (pins_[size_t(s)]) {
            lru_.unlink(s);
            lru_.push_back(s);
            ++walked;
            continue;
        }
        out.append(drop_registered(s));
        ++got;
    }
}

void BlockIndex::check(int32_t s) const {
    if (s < 0 || s >= cap_) throw nb::index_error(("slot " + std::to_string(s) + " out of range").c_str());
}

void BlockIndex::distinct_slots(nb::handle seq, Slots &slots, const char *call) {
    slots_of(seq, cap_, slots);
    slots_once(slots, call);
}

void BlockIndex::slots_once(const Slots &slots, const char *call) {
    size_t i = 0;
    int32_t twice = -1;
    for (; i < slots.size(); ++i) {
        if (seen_[size_t(slots[i])]) {
            twice = slots[i];
            break;
        }
        seen_[size_t(slots[i])] = 1;
    }
    for (size_t j = 0; j < i; ++j) seen_[size_t(slots[j])] = 0;
    if (twice >= 0) throw nb::value_error((std::string(call) + ": slot " + std::to_string(twice) + " appears twice").c_str());
}

void BlockIndex::ids_once(const Keys &keys, const char *call) {
    Py_ssize_t i = repeated_key(keys);
    if (i >= 0)
        throw nb::value_error((std::string(call) + ": block " + hex(keys[size_t(i)]) + " appears twice").c_str());
}

void BlockIndex::not_held(const Keys &keys, const char *call) const {
    bool all[IdGroup::N];
    std::fill(all, all + IdGroup::N, true);
    int32_t found[IdGroup::N];
    int32_t after = -1;
    for (size_t i = 0; i < keys.size(); i += IdGroup::N) {
        Py_ssize_t n = Py_ssize_t(std::min(keys.size() - i, size_t(IdGroup::N)));
        find_group(keys.data() + i, all, n, false, found, after);
        for (Py_ssize_t j = 0; j < n; ++j)
            if (found[j] >= 0) throw BlockStateError(std::string(call) + ": block " + hex(keys[i + size_t(j)]) + " is held already");
    }
}

void BlockIndex::expect_state(int32_t s, State want, State to) const {
    if (state_[size_t(s)] != want || orphan_[size_t(s)]) throw BlockStateError(move_error(s, to, want));
}

std::string BlockIndex::move_error(int32_t s, State to, State from) const {
    return "slot " + std::to_string(s) + ": cannot go " +
           (orphan_[size_t(s)] ? "ORPHANED" : STATE_NAMES[state_[size_t(s)]]) + " -> " + STATE_NAMES[to] +
           " (only from " + STATE_NAMES[from] + ")";
}

}  // namespace kvbm
