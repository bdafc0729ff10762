// SGLang's storage hash of a key's pages, bit for bit (sglang/srt/mem_cache/cpp_utils/hash_binding.cpp, which
// `get_storage_hash_str` runs): page i's digest is SHA-256(digest of page i-1, or the chain's seed, or nothing
// | the page's tokens as little-endian uint32). A page with a token above UINT32_MAX is hashed as uint64 words
// behind one 0xff byte. EAGLE (bigram) keys hash (token, next token) pairs. Pure C++: runs without the GIL.
// tests/index/test_pages.py compares it with SGLang's own on random keys at pages 1, 16 and 64. Releases
// differ only above UINT32_MAX: 0.5.21 and 0.5.22 refuse such a key (their hash packs uint32 only), so the
// tree never offloads one there; 0.5.23 hashes it as a wide page, as here.

#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include "sha256.h"

namespace kvbm {

class PageHasher {
public:
    // ``tokens``: the key's raw ids (one more than its length for bigram keys).
    PageHasher(const std::vector<int64_t> &tokens, size_t page_size, bool bigram,
               std::optional<sha256::Digest> seed)
        : tokens_(tokens), page_size_(page_size), bigram_(bigram), prior_(seed) {
        words_.reserve(page_size * (bigram ? 2 : 1));
    }

    // The digest of page ``page`` (pages are hashed in order: each one chains on the one before).
    const sha256::Digest &next(size_t page) {
        const size_t start = page * page_size_;
        const size_t raw = bigram_ ? page_size_ + 1 : page_size_;
        bool wide = false;
        for (size_t i = 0; i < raw; ++i) {
            const int64_t t = tokens_[start + i];
            if (t < 0) throw std::invalid_argument("token id must be a non-negative int64");
            wide |= uint64_t(t) > UINT32_MAX;
        }
        sha256::Hasher h;
        if (prior_) h.update(prior_->data(), prior_->size());
        if (wide) {
            const uint8_t tag = 0xff;
            h.update(&tag, 1);
            wide_.clear();
            for (size_t i = 0; i < page_size_; ++i) {
                wide_.push_back(uint64_t(tokens_[start + i]));
                if (bigram_) wide_.push_back(uint64_t(tokens_[start + i + 1]));
            }
            h.update(wide_.data(), wide_.size() * sizeof(uint64_t));
        } else {
            words_.clear();
            for (size_t i = 0; i < page_size_; ++i) {
                words_.push_back(uint32_t(tokens_[start + i]));
                if (bigram_) words_.push_back(uint32_t(tokens_[start + i + 1]));
            }
            h.update(words_.data(), words_.size() * sizeof(uint32_t));
        }
        prior_ = h.finish();
        return *prior_;
    }

private:
    const std::vector<int64_t> &tokens_;
    size_t page_size_;
    bool bigram_;
    std::optional<sha256::Digest> prior_;
    std::vector<uint32_t> words_;  // little-endian hosts only (SGLang's hash refuses others too)
    std::vector<uint64_t> wide_;
};

// The event id SGLang publishes for a digest: its first 8 bytes, big-endian, as int64 (`hash_str_to_int64`).
inline int64_t event_id(const sha256::Digest &d) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | d[i];
    return int64_t(v);
}

}  // namespace kvbm
