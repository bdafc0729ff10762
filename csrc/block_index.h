// BlockIndex: which slot of one tier holds which block (``sglang_kvbm._blocks``; bindings: module.cpp).
//
// One per tier (host rows, staging rows, disk slots). Everything the scheduler
// thread asks of a tier about a node's pages is one call here: the leading run
// held, which pages are missing, reserve/commit/abort a copy's slots, pin/unpin
// a load's rows, touch a prefix, evict least recently used blocks.
//
// * Block ids arrive as SGLang hands them (64-character hex sha256 strings) or
//   as 32 raw bytes; inside they are 32 raw bytes, never a Python object. A batch
//   is probed a group of ids at a time (``IdGroup``, ``find_group``), its memory
//   reads overlapped: at SGLang's page size 1 a request is thousands of ids.
// * Per slot: its key, its lifecycle state (KVBM's FREE -> MUTABLE ->
//   REGISTERED -> FREE; see ``core/lifecycle.py``), pin count, the holders of
//   an orphan (a slot a copy still uses after the tier forgot its block),
//   intrusive LRU links, and one Python object the tier keeps beside it (the
//   host's BlockMeta, the disk's header).
// * An open-addressing table maps key -> slot for blocks registered or being written.
//
// Every call that changes state reads its whole batch and checks it first (types, ranges, repeats,
// states), then changes state without running Python code: a refused call changes nothing. A payload
// the index lets go is released when the call returns (its ``__del__`` may call back in), or handed
// back. Lookups (``run``, ``held_by``) stop at the first id not held and do not read the rest: a
// malformed id after a miss is not reported (page-size-1 lookups would otherwise parse whole tails).
//
// Scheduler thread only, called with the GIL held (each call is a few
// microseconds at most: releasing the GIL would cost more than it saves).
#pragma once

#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "block_ids.h"
#include "key_table.h"
#include "py_seq.h"

namespace kvbm {

enum State : uint8_t { FREE = 0, MUTABLE = 1, COMMITTED = 2, REGISTERED = 3 };

struct BlockStateError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

class BlockIndex {
  public:
    // ``all_free``: every slot usable and free (host rows); else none until ``set_free``/``restore`` (disk).
    BlockIndex(int32_t capacity, bool all_free);

    int32_t capacity() const { return cap_; }
    size_t size() const { return registered_; }

    // -- membership, one call per node (read-only) ------------------------------------------
    bool holds(nb::handle id) const { return find(parse(id.ptr())) >= 0; }
    bool registered(nb::handle id) const { return registered_slot(parse(id.ptr())) >= 0; }
    nb::object slot(nb::handle id) const;
    nb::list slots(nb::handle ids) const;     // registered: the slot; else None
    Py_ssize_t run(nb::handle ids) const;     // leading ids registered here
    nb::list missing(nb::handle ids) const;   // positions of ids neither registered nor being written
    nb::bytes flags(nb::handle ids) const;    // per id, 1 registered here, else 0

    // -- a copy's slots: reserve -> commit, or abort ----------------------------------------
    nb::tuple reserve(nb::handle ids);
    nb::tuple reserve_missing(nb::handle ids);
    void commit(nb::handle slot_seq, nb::handle payloads);
    void restore(nb::handle slot_seq, nb::handle ids, nb::handle payloads);
    void abort(nb::handle slot_seq);
    void release_orphans(nb::handle slot_seq);

    // -- reads of registered blocks ---------------------------------------------------------
    void touch(nb::handle ids);
    void touch_slots(const Slots &found);  // ``touch`` of the slots found (-1: skipped), the first most recent
    // The run a lookup (``held_by(..., touch=True)``) just found here: its keys and slots (-1: not here), no
    // Python object (holding the ids would move their release, a cache miss each, into the next lookup). A
    // later call handed the same ids at the same positions (the load's ``pin`` of the prefix its lookup found,
    // its ``metas_of``; the offload of the node the load became, ``reserve_missing``, as new strings) takes
    // each one's slot from it without a probe while that slot still registers that key (``recall``).
    void remember(const Key *keys, const int32_t *slots, Py_ssize_t n);
    nb::object pin(nb::handle ids);  // an array('i') of the slots
    void unpin(nb::handle ids);
    void unpin_slots(nb::handle slot_seq);
    int32_t pins(nb::handle id) const;

    // -- dropping blocks --------------------------------------------------------------------
    nb::list remove(nb::handle ids, bool skip_pinned);
    nb::list drop_slots(nb::handle slot_seq);
    nb::list forget(bool keep_pinned);

    // -- what is kept -----------------------------------------------------------------------
    nb::object payload(int32_t s) const;
    nb::list payloads(nb::handle ids) const;
    nb::list items() const;
    int state(int32_t s) const;

    // -- where the slots are ----------------------------------------------------------------
    size_t free_count() const { return free_.size(); }
    size_t inflight_count() const { return inflight_; }
    size_t pinned_count() const { return pinned_; }
    size_t orphan_count() const { return orphans_; }
    void set_free(nb::handle slot_seq);
    void add_free(nb::handle slot_seq);

    // The slot of a registered key, or -1.
    int32_t registered_slot(const Key &k) const {
        int32_t s = find(k);
        return s >= 0 && state_[size_t(s)] == REGISTERED ? s : -1;
    }

    // ``find`` (``registered``: ``registered_slot``) for a group of keys at once, ``out[j]`` for ``keys[j]``
    // (-1 where ``ok[j]`` is false). A run stored together sits in consecutive slots (slots go out in
    // ascending order), so each key is first looked for in the slot after the previous key's, with no table
    // probe (its key and state lie next to the ones just read); ``after`` is the slot of the key before
    // ``keys[0]`` (-1: not held; ``FIRST_OF_BATCH``: there is none) and becomes ``keys[n-1]``'s. The keys not
    // found that way are probed as a group: every home cell is fetched, then every first candidate's key and
    // state, before any is compared, so their cache misses overlap (``held_by`` calls it once per index).
    void find_group(const Key *keys, const bool *ok, Py_ssize_t n, bool registered, int32_t *out,
                    int32_t &after) const;
    static constexpr int32_t FIRST_OF_BATCH = -3;

    // The garbage collector's view: the payloads kept (tp_traverse), and letting them go (tp_clear).
    int traverse(visitproc visit, void *arg) const;
    void clear_payloads();

  private:
    int32_t cap_;
    std::vector<Key> keys_;
    std::vector<uint8_t> state_, mapped_, usable_, seen_;  // seen_: all zero between calls
    std::vector<int32_t> pins_, orphan_;
    std::vector<nb::object> payload_;
    FreeList free_;
    KeyTable table_;  // key -> slot, for blocks registered or being written
    LruLinks lru_;    // registered slots
    size_t registered_ = 0, inflight_ = 0, pinned_ = 0, orphans_ = 0;
    std::vector<Key> recent_keys_;  // ``remember``
    std::vector<int32_t> recent_slots_;

    int32_t find(const Key &k) const { return table_.find(k, keys_); }
    void map(int32_t s, const Key &k);
    void unmap(int32_t s);
    void release(int32_t s);
    void release_orphan(int32_t s);
    nb::object drop_registered(int32_t s);
    void evict(size_t n, nb::list &out);
    void take_slots(const Keys &keys, Slots &got, nb::list &evicted);
    void check(int32_t s) const;

    Py_ssize_t registered_slots(nb::handle ids, Slots &out) const;
    // How many leading ids are the remembered run's (equal ids: the same objects, or new strings the tree hands
    // an offload), whose slots still register their keys (their slots into ``out``). Stops at the first id that
    // differs or does not parse (a malformed one is read, and raised, by the caller's walk from there). No table
    // probe: the slots' cells are fetched a group ahead.
    Py_ssize_t recall(const Items &it, int32_t *out) const {
        constexpr size_t AHEAD = size_t(IdGroup::N);
        const size_t n = std::min(size_t(it.n), recent_keys_.size());
        for (size_t j = 0; j < std::min(n, AHEAD); ++j) prefetch_slot(recent_slots_[j]);
        size_t i = 0;
        for (; i < n; ++i) {
            if (i + AHEAD < n) prefetch_slot(recent_slots_[i + AHEAD]);
            const Key &want = recent_keys_[i];
            Key k;
            int32_t s = recent_slots_[i];
            if (!try_parse(it.items[i], k) || !(k == want) || s < 0 || !mapped_[size_t(s)] ||
                state_[size_t(s)] != REGISTERED || !(keys_[size_t(s)] == want))
                break;
            out[i] = s;
        }
        return Py_ssize_t(i);
    }
    void prefetch_slot(int32_t s) const {
        if (s >= 0) {
            KVBM_PREFETCH(&keys_[size_t(s)]);
            KVBM_PREFETCH(&state_[size_t(s)]);
            KVBM_PREFETCH(&mapped_[size_t(s)]);
        }
    }
    // Each id's slot (``registered``: -1 where not registered; else -1 where neither registered nor being
    // written), a group at a time, from id ``from`` on; ``f(i, slot, key)`` false stops the walk (the ids
    // after it are not read: a malformed one is not reported). A malformed id reached raises.
    template <class F>
    void each_slot(const Items &it, bool registered, F &&f, Py_ssize_t from = 0) const {
        IdGroup g;
        int32_t found[IdGroup::N];
        int32_t after = FIRST_OF_BATCH;
        for (Py_ssize_t i = from; i < it.n; i += IdGroup::N) {
            g.read(it.items, it.n, i);
            find_group(g.key, g.ok, g.n, registered, found, after);
            for (Py_ssize_t j = 0; j < g.n; ++j) {
                if (!g.ok[j]) bad_id(it.items[i + j]);
                if (!f(i + j, found[j], g.key[j])) return;
            }
        }
    }

    // Batch checks: raise before anything changes.
    void distinct_slots(nb::handle seq, Slots &slots, const char *call);  // slots_of + slots_once
    void slots_once(const Slots &slots, const char *call);
    static void ids_once(const Keys &keys, const char *call);
    void not_held(const Keys &keys, const char *call) const;
    void expect_state(int32_t s, State want, State to) const;
    std::string move_error(int32_t s, State to, State from) const;
};

}  // namespace kvbm
