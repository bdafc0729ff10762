// Block ids: SGLang's 64-character hex sha256 storage hashes (or their 32 bytes) -> 32 raw bytes.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

namespace kvbm {
namespace nb = nanobind;

struct Key {
    uint64_t w[4];
    bool operator==(const Key &o) const { return std::memcmp(w, o.w, sizeof(w)) == 0; }
};

// For messages: the key as SGLang writes it.
inline std::string hex(const Key &k) {
    static const char *digits = "0123456789abcdef";
    const uint8_t *b = reinterpret_cast<const uint8_t *>(k.w);
    std::string out(64, '0');
    for (int i = 0; i < 32; ++i) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    return out;
}

// 64 hex characters -> 32 bytes; false if any character is not hex (either case). SSE2 on x86-64 (16
// characters a step, ~10 ns an id), the same arithmetic in 64-bit registers elsewhere: per character, its
// value is its low nibble, plus 9 for a letter (bit 6); it is hex if that value is below 16 and the
// character it stands for, in lower case, is the character given (letters lowered).
#if defined(__SSE2__) || defined(_M_X64)
inline bool unhex(const uint8_t *s, uint8_t *out) {
    const __m128i ones = _mm_set1_epi8(1), low = _mm_set1_epi8(0x0F), fifteen = _mm_set1_epi8(15);
    __m128i bad = _mm_setzero_si128();
    for (int i = 0; i < 4; ++i) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + 16 * i));
        __m128i letter = _mm_and_si128(_mm_srli_epi16(c, 6), ones);
        __m128i nib = _mm_add_epi8(_mm_and_si128(c, low), _mm_mullo_epi16(letter, _mm_set1_epi16(9)));
        __m128i ge10 = _mm_cmpgt_epi8(nib, _mm_set1_epi8(9));
        __m128i canon = _mm_add_epi8(_mm_add_epi8(nib, _mm_set1_epi8(0x30)), _mm_and_si128(ge10, _mm_set1_epi8(0x27)));
        __m128i lowered = _mm_or_si128(c, _mm_and_si128(_mm_srli_epi16(c, 1), _mm_set1_epi8(0x20)));
        bad = _mm_or_si128(bad, _mm_cmpgt_epi8(nib, fifteen));
        bad = _mm_or_si128(bad, _mm_andnot_si128(_mm_cmpeq_epi8(canon, lowered), _mm_set1_epi8(-1)));
        __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(nib, _mm_set1_epi16(0x000F)), 4),
                                     _mm_srli_epi16(nib, 8));
        _mm_storel_epi64(reinterpret_cast<__m128i *>(out + 8 * i), _mm_packus_epi16(pairs, pairs));
    }
    return _mm_movemask_epi8(bad) == 0;
}
#else
inline bool unhex(const uint8_t *s, uint8_t *out) {
    constexpr uint64_t ONES = 0x0101010101010101ull;
    uint64_t bad = 0;
    for (int i = 0; i < 8; ++i) {
        uint64_t c;
        std::memcpy(&c, s + 8 * i, 8);  // little-endian: the first character in the lowest byte
        uint64_t letter = (c >> 6) & ONES;
        uint64_t nib = (c & 0x0F * ONES) + letter * 9;  // <= 24 per byte: no carries
        uint64_t ge10 = ((nib + 0x76 * ONES) >> 7) & ONES;
        uint64_t canon = nib + 0x30 * ONES + ge10 * 0x27;
        uint64_t lowered = c | ((c >> 1) & 0x20 * ONES);
        bad |= ((nib + 0x70 * ONES) & 0x80 * ONES) | (canon ^ lowered);
        uint64_t pairs = ((nib & 0x000F000F000F000Full) << 4) | ((nib >> 8) & 0x000F000F000F000Full);
        pairs = (pairs | pairs >> 8) & 0x0000FFFF0000FFFFull;
        uint32_t four = uint32_t(pairs | pairs >> 16);
        std::memcpy(out + 4 * i, &four, 4);
    }
    return bad == 0;
}
#endif

// For messages: ``ascii(o)``, shortened. Runs Python code (``__repr__``), so ``o`` is held meanwhile; a
// ``__repr__`` that fails gives the type's name.
inline std::string shown(PyObject *o) {
    nb::object held = nb::borrow(o);
    nb::object text = nb::steal(PyObject_ASCII(o));
    Py_ssize_t n = 0;
    const char *utf8 = text.is_valid() ? PyUnicode_AsUTF8AndSize(text.ptr(), &n) : nullptr;
    if (!utf8) {
        PyErr_Clear();
        return std::string("<") + Py_TYPE(o)->tp_name + ">";
    }
    std::string out(utf8, size_t(n));
    return out.size() > 80 ? out.substr(0, 77) + "..." : out;
}

[[noreturn]] inline void bad_id(PyObject *o) {
    if (!PyUnicode_Check(o) && !PyBytes_Check(o))
        throw nb::type_error((std::string("a block id is a str (64 hex characters) or 32 bytes, not ") +
                              Py_TYPE(o)->tp_name).c_str());
    throw nb::value_error(("a block id is a sha256 digest: 64 hex characters (SGLang's storage hash) or 32 "
                           "bytes; got " + shown(o)).c_str());
}

// An id as 32 raw bytes into ``k``; false if it is not an id. Runs no Python code.
inline bool try_parse(PyObject *o, Key &k) {
    uint8_t *out = reinterpret_cast<uint8_t *>(k.w);
    if (PyUnicode_Check(o))
        return PyUnicode_GET_LENGTH(o) == 64 && PyUnicode_KIND(o) == PyUnicode_1BYTE_KIND &&
               unhex(PyUnicode_1BYTE_DATA(o), out);
    if (PyBytes_Check(o) && PyBytes_GET_SIZE(o) == 32) {
        std::memcpy(out, PyBytes_AS_STRING(o), 32);
        return true;
    }
    return false;
}

// An id as 32 raw bytes. Runs no Python code unless the id is bad (then it raises).
inline Key parse(PyObject *o) {
    Key k;
    if (!try_parse(o, k)) bad_id(o);
    return k;
}

#if defined(__GNUC__) || defined(__clang__)
#define KVBM_PREFETCH(p) __builtin_prefetch(p)
#else
#define KVBM_PREFETCH(p) ((void)(p))
#endif

// A batch's ids a group at a time (``read``): the group parsed, and the next group's id objects fetched
// meanwhile, so that the index's probes for a whole group (``BlockIndex::find_group``) overlap their memory
// reads instead of waiting for each in turn (a tier's table and keys are megabytes: most probes miss the
// cache). A malformed id is marked, not raised: the caller raises when it reaches it (lookups that stop at
// a miss never reach the ids after it).
struct IdGroup {
    static constexpr Py_ssize_t N = 16;
    Key key[N];
    bool ok[N];
    Py_ssize_t base = 0, n = 0;

    void read(PyObject *const *items, Py_ssize_t count, Py_ssize_t from) {
        base = from;
        n = std::min(N, count - from);
        for (Py_ssize_t j = from + N, end = std::min(count, from + 2 * N); j < end; ++j) {
            const char *o = reinterpret_cast<const char *>(items[j]);  // a str's 64 characters follow its header
            KVBM_PREFETCH(o);
            KVBM_PREFETCH(o + 64);
            KVBM_PREFETCH(o + 120);
        }
        for (Py_ssize_t j = 0; j < n; ++j) ok[j] = try_parse(items[from + j], key[j]);
    }
};

// sha256 bytes are uniform already; the multiply only spreads ids a test made by hand.
inline size_t key_hash(const Key &k) { return size_t((k.w[0] ^ k.w[3]) * 0x9E3779B97F4A7C15ull >> 17); }

}  // namespace kvbm
