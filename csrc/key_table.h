// Key -> slot: open addressing, linear probing, backward-shift deletion (no tombstones), load <= 1/2.
// The keys live in the owner's per-slot array; the table holds slot numbers only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_ids.h"

namespace kvbm {

class KeyTable {
  public:
    explicit KeyTable(int32_t slots) {
        size_t size = 16;
        while (size < size_t(slots) * 2) size <<= 1;
        table_.assign(size, -1);
        mask_ = size - 1;
    }

    // The slot holding ``k`` among ``keys``, or -1.
    int32_t find(const Key &k, const std::vector<Key> &keys) const {
        for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
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
        while (table_[i] != s) i = (i + 1) & mask_;
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

    // sha256 bytes are uniform already; the multiply only spreads ids a test made by hand.
    static size_t hash(const Key &k) { return size_t((k.w[0] ^ k.w[3]) * 0x9E3779B97F4A7C15ull >> 17); }
};

// Slots in least- to most-recently-used order: an intrusive doubly linked list over slot numbers.
class LruLinks {
  public:
    explicit LruLinks(int32_t slots) : prev_(slots, -1), next_(slots, -1) {}

    int32_t head() const { return head_; }  // least recently used, or -1
    int32_t next(int32_t s) const { return next_[s]; }

    void push_back(int32_t s) {  // most recent
        prev_[s] = tail_;
        next_[s] = -1;
        if (tail_ >= 0) next_[tail_] = s; else head_ = s;
        tail_ = s;
    }

    void unlink(int32_t s) {
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

}  // namespace kvbm
