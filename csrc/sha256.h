// SHA-256 (FIPS 180-4) for SGLang's page hashes, without a shared library (the wheel stays repairable by
// auditwheel, and SGLang's own hash links OpenSSL through a JIT build we cannot count on).
//
// Two compression functions, chosen once per process: the x86 SHA extensions where the CPU has them, else a
// portable one. Both are checked against Python's hashlib on random inputs (tests/index/test_pages.py), and
// `_blocks.sha256(data, portable=True)` runs either on demand.

#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define KVBM_SHA_X86 1
#endif

namespace kvbm::sha256 {

using Digest = std::array<uint8_t, 32>;
using Compress = void (*)(uint32_t state[8], const uint8_t *blocks, size_t count);

alignas(16) inline constexpr uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline void compress_portable(uint32_t state[8], const uint8_t *p, size_t count) {
    for (; count--; p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; ++t)
            w[t] = uint32_t(p[4 * t]) << 24 | uint32_t(p[4 * t + 1]) << 16 | uint32_t(p[4 * t + 2]) << 8 | p[4 * t + 3];
        for (int t = 16; t < 64; ++t) {
            uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; ++t) {
            uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t];
            uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        state[0] += a, state[1] += b, state[2] += c, state[3] += d;
        state[4] += e, state[5] += f, state[6] += g, state[7] += h;
    }
}

#ifdef KVBM_SHA_X86
// The SHA extensions' two-rounds instruction over the state as (ABEF, CDGH) halves.
__attribute__((target("sha,sse4.1,ssse3"))) inline void compress_x86(uint32_t state[8], const uint8_t *p,
                                                                     size_t count) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);  // big-endian words
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(state)), 0xB1);
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(state + 4)), 0x1B);
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);  // ABEF
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);       // CDGH
    for (; count--; p += 64) {
        const __m128i abef = s0, cdgh = s1;
        __m128i m[4];
        for (int i = 0; i < 16; ++i) {
            __m128i w;
            if (i < 4) {
                w = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16 * i)), swap);
            } else {
                w = _mm_add_epi32(_mm_sha256msg1_epu32(m[i & 3], m[(i + 1) & 3]),
                                  _mm_alignr_epi8(m[(i + 3) & 3], m[(i + 2) & 3], 4));
                w = _mm_sha256msg2_epu32(w, m[(i + 3) & 3]);
            }
            m[i & 3] = w;
            __m128i msg = _mm_add_epi32(w, _mm_load_si128(reinterpret_cast<const __m128i *>(K + 4 * i)));
            s1 = _mm_sha256rnds2_epu32(s1, s0, msg);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(msg, 0x0E));
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);   // FEBA
    s1 = _mm_shuffle_epi32(s1, 0xB1);    // DCHG
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);  // DCBA
    s1 = _mm_alignr_epi8(s1, tmp, 8);     // HGFE
    _mm_storeu_si128(reinterpret_cast<__m128i *>(state), s0);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(state + 4), s1);
}

inline bool cpu_has_sha() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (b >> 29) & 1;
}
#endif

inline Compress best() {
#ifdef KVBM_SHA_X86
    static const Compress chosen = cpu_has_sha() ? compress_x86 : compress_portable;
    return chosen;
#else
    return compress_portable;
#endif
}

// Streaming SHA-256 over one compression function.
class Hasher {
public:
    explicit Hasher(Compress compress = best()) : compress_(compress) {}

    void update(const void *data, size_t n) {
        auto p = static_cast<const uint8_t *>(data);
        total_ += n;
        if (used_) {
            size_t take = std::min(n, size_t(64) - used_);
            std::memcpy(buf_ + used_, p, take);
            used_ += take, p += take, n -= take;
            if (used_ < 64) return;
            compress_(state_, buf_, 1);
            used_ = 0;
        }
        if (n >= 64) {
            compress_(state_, p, n / 64);
            p += n / 64 * 64, n %= 64;
        }
        std::memcpy(buf_, p, n);
        used_ = n;
    }

    Digest finish() {
        uint64_t bits = total_ * 8;
        uint8_t pad[72] = {0x80};
        size_t fill = (used_ < 56 ? 56 : 120) - used_;
        for (int i = 0; i < 8; ++i) pad[fill + i] = uint8_t(bits >> (56 - 8 * i));
        update(pad, fill + 8);
        Digest out;
        for (int i = 0; i < 8; ++i)
            for (int j = 0; j < 4; ++j) out[4 * i + j] = uint8_t(state_[i] >> (24 - 8 * j));
        return out;
    }

private:
    Compress compress_;
    uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    uint8_t buf_[64];
    size_t used_ = 0;
    uint64_t total_ = 0;
};

}  // namespace kvbm::sha256
