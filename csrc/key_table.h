// The block index's per-tier structures over slot numbers: key -> slot, the LRU order, the free list.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "block_ids.h"

namespace kvbm {

// An invariant the index keeps is broken: stop here, loudly, rather than spin or hand one slot out twice.
[[noreturn]] inline void corrupted(const char *what) {
    std::fprintf(stderr, "sglang_kvbm._blocks: internal invariant broken: %s\n", what);
    std::abort();
}

// Key -> slot: open addressing, linear probing, backward-shift deletion (no tombstones), load <= 1/2.
// The keys live in the owner's per-slot array; the table holds slot numbers only.
class KeyTable {
  public:
    explicit KeyTable(int32_t slots) {
        size_t size = 16;
        while (size < size_t(slots) * 2) size <<= 1;
        table_.assign(size, -1);
        mask_ = size - 1;
    }

    // The slot holding ``k`` among ``keys``, or -1.
    int32_t find(const Key &k, const std::vector<Key> &keys) const { return find_from(home(k), k, keys); }

    // ``find`` in steps, for probing many keys at once: a key's home cell, that cell fetched ahead
    // (``prefetch``), its first candidate (``first``: then fetch that slot's key), the search from it.
    size_t home(const Key &k) const { return hash(k) & mask_; }
    void prefetch(size_t cell) const { KVBM_PREFETCH(&table_[cell]); }
    int32_t first(size_t cell) const { return table_[cell]; }
    int32_t find_from(size_t cell, const Key &k, const std::vector<Key> &keys) const {
        for (size_t i = cell;; i = (i + 1) & mask_) {
            int32_t s = table_[i];
            if (s < 0) return -1;
            if (keys[s] == k) return s;
        }
    }

    void insert(int32_t s, const std::vector<Key> &keys) {
        size_t i = hash(keys[s]) & mask_;
        while (table_[i] >= 0) i = (i + 1) & mask_;
        table_[i] = s;
    }

    void erase(int32_t s, const std::vector<Key> &keys) {
        size_t i = hash(keys[s]) & mask_;
        while (table_[i] != s) {
            if (table_[i] < 0) corrupted("KeyTable::erase of a slot not in the table");
            i = (i + 1) & mask_;
        }
        // Move later entries of the probe run into the hole, unless their home lies after it.
        for (size_t j = (i + 1) & mask_; table_[j] >= 0; j = (j + 1) & mask_) {
            size_t home = hash(keys[table_[j]]) & mask_;
            if (((j - home) & mask_) >= ((j - i) & mask_)) {
                table_[i] = table_[j];
                i = j;
            }
        }
        table_[i] = -1;
    }

    void clear() { std::fill(table_.begin(), table_.end(), -1); }

  private:
    std::vector<int32_t> table_;
    size_t mask_;

    static size_t hash(const Key &k) { return key_hash(k); }
};

// Slots in least- to most-recently-used order: an intrusive doubly linked list over slot numbers. A slot
// linked twice or unlinked while out of the list is a broken invariant (a caller touched a slot that is not
// registered): it aborts rather than leave a cycle that a later walk would loop on.
class LruLinks {
  public:
    explicit LruLinks(int32_t slots) : prev_(slots, -1), next_(slots, -1) {}

    int32_t head() const { return head_; }  // least recently used, or -1
    int32_t next(int32_t s) const { return next_[s]; }

    void push_back(int32_t s) {  // most recent
        if (prev_[s] >= 0 || head_ == s) corrupted("LruLinks::push_back of a slot already in the list");
        prev_[s] = tail_;
        next_[s] = -1;
        if (tail_ >= 0) next_[tail_] = s; else head_ = s;
        tail_ = s;
    }

    void unlink(int32_t s) {
        if (prev_[s] < 0 && head_ != s) corrupted("LruLinks::unlink of a slot not in the list");
        if (prev_[s] >= 0) next_[prev_[s]] = next_[s]; else head_ = next_[s];
        if (next_[s] >= 0) prev_[next_[s]] = prev_[s]; else tail_ = prev_[s];
        prev_[s] = next_[s] = -1;
    }

    void clear() {
        std::fill(prev_.begin(), prev_.end(), -1);
        std::fill(next_.begin(), next_.end(), -1);
        head_ = tail_ = -1;
    }

  private:
    std::vector<int32_t> prev_, next_;
    int32_t head_ = -1, tail_ = -1;
};

// Slots a reserve may take, taken from the end; each slot at most once (``listed``).
class FreeList {
  public:
    explicit FreeList(int32_t slots) : listed_(size_t(slots), 0) {}

    size_t size() const { return stack_.size(); }
    bool empty() const { return stack_.empty(); }
    bool listed(int32_t s) const { return listed_[size_t(s)]; }
    void reserve(size_t n) { stack_.reserve(n); }

    void push(int32_t s) {
        if (listed_[size_t(s)]) return;
        listed_[size_t(s)] = 1;
        stack_.push_back(s);
    }

    int32_t pop() {
        int32_t s = stack_.back();
        stack_.pop_back();
        listed_[size_t(s)] = 0;
        return s;
    }

    void clear() {
        for (int32_t s : stack_) listed_[size_t(s)] = 0;
        stack_.clear();
    }

    // Take these slots out, keeping the others' order.
    template <class Seq>
    void remove(const Seq &slots) {
        bool any = false;
        for (int32_t s : slots)
            if (listed_[size_t(s)]) {
                listed_[size_t(s)] = 0;
                any = true;
            }
        if (any) stack_.erase(std::remove_if(stack_.begin(), stack_.end(), [&](int32_t s) { return !listed_[size_t(s)]; }),
                              stack_.end());
    }

  private:
    std::vector<int32_t> stack_;
    std::vector<uint8_t> listed_;
};

}  // namespace kvbm
