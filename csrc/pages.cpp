// Page records (pages.h): describing a node from its inserted key, views of its pages, and the bulk reads the
// event sink and the tiers make of a list of views.

#include "pages.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "block_ids.h"
#include "page_hash.h"
#include "py_seq.h"

namespace kvbm {

namespace {

// A key as SGLang writes it (64 lowercase hex digits) into its digest; false for anything else. The hex is
// decoded by the block index's own parser (block_ids.h), which also takes upper case: SGLang never writes it.
bool parse_hex(nb::handle key, sha256::Digest &out) {
    if (!PyUnicode_Check(key.ptr()) || PyUnicode_GET_LENGTH(key.ptr()) != 64 ||
        PyUnicode_KIND(key.ptr()) != PyUnicode_1BYTE_KIND)
        return false;
    const uint8_t *s = PyUnicode_1BYTE_DATA(key.ptr());
    return std::none_of(s, s + 64, [](uint8_t c) { return c >= 'A' && c <= 'F'; }) && unhex(s, out.data());
}

nb::str hex_of(const sha256::Digest &d) {
    Key k;
    std::memcpy(k.w, d.data(), sizeof(k.w));
    const std::string text = hex(k);
    return nb::str(text.data(), text.size());
}

// Token ids from an int buffer (array 'q', 'l', 'Q', 'L', 'i', 'I') or any sequence of ints.
std::vector<int64_t> read_tokens(nb::handle obj) {
    std::vector<int64_t> out;
    if (PyObject_CheckBuffer(obj.ptr())) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
        const char *f = view.format ? view.format : "B";
        const char code = f[std::strlen(f) - 1];
        const size_t count = size_t(view.len / view.itemsize);
        bool ok = true;
        if (view.itemsize == 8 && std::strchr("qlQLnN", code)) {
            out.resize(count);
            std::memcpy(out.data(), view.buf, count * 8);  // above INT64_MAX reads negative: refused when hashed
        } else if (view.itemsize == 4 && std::strchr("iIlL", code)) {
            out.reserve(count);
            for (size_t i = 0; i < count; ++i) {
                if (code == 'I' || code == 'L') out.push_back(static_cast<const uint32_t *>(view.buf)[i]);
                else out.push_back(static_cast<const int32_t *>(view.buf)[i]);
            }
        } else {
            ok = false;
        }
        PyBuffer_Release(&view);
        if (!ok) throw nb::type_error("token ids: a buffer of 4- or 8-byte integers, or a sequence of ints");
        return out;
    }
    nb::tuple items = nb::steal<nb::tuple>(PySequence_Tuple(obj.ptr()));  // ours: __index__ cannot change it
    if (!items.is_valid()) throw nb::python_error();
    out.reserve(items.size());
    for (nb::handle t : items) {
        long long v = PyLong_AsLongLong(t.ptr());
        if (v == -1 && PyErr_Occurred()) throw nb::python_error();
        out.push_back(v);
    }
    return out;
}

nb::tuple tuple_of(nb::handle seq) {
    if (PyTuple_CheckExact(seq.ptr())) return nb::borrow<nb::tuple>(seq);
    nb::tuple t = nb::steal<nb::tuple>(PySequence_Tuple(seq.ptr()));
    if (!t.is_valid()) throw nb::python_error();
    return t;
}

void check_tokens(const Pages &p) {
    if (p.page_size == 0) throw nb::value_error("page_size must be positive");
    if (!p.tokens.empty() && p.tokens.size() != p.n * p.page_size + (p.bigram && p.n ? 1 : 0))
        throw nb::value_error(("token_ids: " + std::to_string(p.tokens.size()) + " for " + std::to_string(p.n) +
                               " pages of " + std::to_string(p.page_size) + (p.bigram ? " (bigram)" : ""))
                                  .c_str());
}

// A node's record from its inserted key: the key's full pages are hashed from the start (or ``seed``) until the
// node's first key, and each of its keys is checked against its tokens.
nb::object describe(nb::handle tokens_obj, size_t length, size_t page_size, bool bigram, nb::handle seed_obj,
                    nb::handle keys_obj, bool events) {
    if (page_size == 0) throw nb::value_error("page_size must be positive");
    refuse_one_id(keys_obj);
    Pages p;
    p.ids = tuple_of(keys_obj);
    p.n = p.ids.size();
    p.page_size = page_size;
    p.bigram = bigram;
    std::vector<int64_t> tokens = read_tokens(tokens_obj);
    if (tokens.size() < length + (bigram && length ? 1 : 0)) throw nb::value_error("token ids shorter than length");
    std::optional<sha256::Digest> seed;
    if (!seed_obj.is_none()) {
        nb::bytes b = nb::borrow<nb::bytes>(seed_obj);
        if (b.size() != 32) throw nb::value_error("seed: 32 bytes");
        seed.emplace();
        std::memcpy(seed->data(), b.c_str(), 32);
    }
    std::vector<sha256::Digest> keys(p.n);
    std::vector<bool> parsed(p.n);
    for (size_t i = 0; i < p.n; ++i) parsed[i] = parse_hex(p.ids[i], keys[i]);
    const size_t total = length / page_size;
    std::optional<sha256::Digest> before;
    size_t start = 0;
    std::string error;
    {
        nb::gil_scoped_release unlocked;
        PageHasher hasher(tokens, page_size, bigram, seed);
        bool found = false;
        if (p.n && parsed[0]) {
            for (; start < total; ++start) {
                const sha256::Digest &d = hasher.next(start);
                if (d == keys[0]) {
                    found = true;
                    break;
                }
                before = d;
            }
        }
        if (!found) {
            error = "the stored node is not on the inserted key's path";
        } else if (start + p.n > total) {
            error = "the stored node's keys run past the inserted key";
        } else {
            for (size_t j = 1; j < p.n && error.empty(); ++j)
                if (!parsed[j] || hasher.next(start + j) != keys[j])
                    error = "the stored node's keys do not follow the inserted key (page " + std::to_string(j) + ")";
        }
        if (error.empty()) {
            const size_t from = start * page_size, to = (start + p.n) * page_size + (bigram ? 1 : 0);
            p.tokens.assign(tokens.begin() + from, tokens.begin() + to);
            if (events) {
                p.event_hash.reserve(p.n);
                for (const auto &k : keys) p.event_hash.push_back(event_id(k));
                if (before) p.event_parent = event_id(*before);
            }
        }
    }
    if (!error.empty()) throw PageIdentityError(error);
    p.parent = before ? nb::object(hex_of(*before)) : nb::none();
    p.start = start;
    p.events = events;
    p.cache_salt = p.lora_name = nb::none();
    return nb::cast(std::move(p), nb::rv_policy::move);
}

Page view(nb::handle owner, size_t index) {
    const Pages *p = nb::inst_ptr<Pages>(owner);
    if (index >= p->n) throw nb::index_error(("page " + std::to_string(index) + " of " + std::to_string(p->n)).c_str());
    return Page{nb::borrow(owner), p, index};
}

const Page *as_page(nb::handle h) {
    const Page *page = nullptr;
    if (!nb::try_cast<const Page *>(h, page) || !page)
        throw nb::type_error((std::string("expected Page, not ") + Py_TYPE(h.ptr())->tp_name).c_str());
    return page;
}

bool same_object(const nb::object &a, const nb::object &b) {
    if (a.ptr() == b.ptr()) return true;
    int r = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
    if (r < 0) throw nb::python_error();
    return r == 1;
}

bool same_tokens(const Page &a, const Page &b);

bool equal(const Page &a, const Page &b) {
    if (a.pages == b.pages && a.index == b.index) return true;
    if (a.pages->tokens.empty() || b.pages->tokens.empty()) {
        if (a.pages->tokens.empty() != b.pages->tokens.empty()) return false;
    } else if (!same_tokens(a, b)) {
        return false;
    }
    if (a.event_hash() != b.event_hash() || a.event_parent() != b.event_parent()) return false;
    if (a.pages->events && (!same_object(a.pages->cache_salt, b.pages->cache_salt) ||
                            !same_object(a.pages->lora_name, b.pages->lora_name)))
        return false;
    return same_object(a.block_id(), b.block_id()) && same_object(a.parent_id(), b.parent_id());
}

bool same_tokens(const Page &a, const Page &b) {
    const size_t w = a.pages->page_size + (a.pages->bigram ? 1 : 0);
    if (w != b.pages->page_size + (b.pages->bigram ? 1 : 0) || a.pages->bigram != b.pages->bigram) return false;
    return std::equal(a.pages->tokens.begin() + a.index * a.pages->page_size,
                      a.pages->tokens.begin() + a.index * a.pages->page_size + w,
                      b.pages->tokens.begin() + b.index * b.pages->page_size);
}

// One BlockStored's fields for ``pages``, when they are one chain of one namespace (each page's parent in events
// the one before, none bigram): (hashes, parent, token ids, cache_salt, lora_name); None otherwise.
nb::object stored_run(nb::handle seq) {
    nb::tuple items = tuple_of(seq);
    if (!items.size()) return nb::none();
    std::vector<const Page *> pages;
    pages.reserve(items.size());
    for (nb::handle h : items) pages.push_back(as_page(h));
    const Pages *first = pages[0]->pages;
    for (size_t i = 0; i < pages.size(); ++i) {
        const Pages *p = pages[i]->pages;
        if (!p->events || p->bigram || p->tokens.empty() || p->page_size != first->page_size) return nb::none();
        if (p != first && (!same_object(p->cache_salt, first->cache_salt) ||
                           !same_object(p->lora_name, first->lora_name)))
            return nb::none();
        if (i && pages[i]->event_parent() != pages[i - 1]->event_hash()) return nb::none();
    }
    nb::list hashes, tokens;
    for (const Page *page : pages) {
        hashes.append(*page->event_hash());
        auto at = page->pages->tokens.begin() + page->index * page->pages->page_size;
        for (size_t t = 0; t < page->pages->page_size; ++t) tokens.append(at[t]);
    }
    auto parent = pages[0]->event_parent();
    return nb::make_tuple(hashes, parent ? nb::object(nb::int_(*parent)) : nb::none(), tokens, first->cache_salt,
                          first->lora_name);
}

// Positions of the pages whose parent is not the page before them in ``seq`` (the first always): only those
// need their parent looked up (a store keeps a page only if its parent is held). One pass, no ids compared.
nb::list unchained(nb::handle seq) {
    nb::list out;
    const Page *before = nullptr;
    size_t i = 0;
    for (nb::handle h : tuple_of(seq)) {
        const Page *page = as_page(h);
        if (!before || page->pages != before->pages || page->index != before->index + 1) out.append(i);
        before = page;
        ++i;
    }
    return out;
}

nb::list event_hashes(nb::handle seq) {
    nb::list out;
    for (nb::handle h : tuple_of(seq)) {
        auto e = as_page(h)->event_hash();
        if (e) out.append(*e);
    }
    return out;
}

}  // namespace

nb::tuple Page::token_ids() const {
    if (pages->tokens.empty()) return nb::tuple();
    const size_t w = pages->page_size + (pages->bigram ? 1 : 0);
    nb::tuple out = nb::steal<nb::tuple>(PyTuple_New(Py_ssize_t(w)));
    auto at = pages->tokens.begin() + index * pages->page_size;
    for (size_t t = 0; t < w; ++t) PyTuple_SET_ITEM(out.ptr(), Py_ssize_t(t), PyLong_FromLongLong(at[t]));
    return out;
}

void bind_pages(nb::module_ &m) {
    nb::exception<PageIdentityError>(m, "PageIdentityError", PyExc_RuntimeError);
    nb::class_<Pages>(m, "Pages", "One node's pages: block ids, token ids, parent, KV-event ids (csrc/pages.h).")
        .def(
            "__init__",
            [](Pages *self, nb::handle ids, nb::handle token_ids, size_t page_size, nb::object parent_id, bool bigram,
               std::optional<std::vector<int64_t>> event_hashes, std::optional<int64_t> event_parent,
               nb::object cache_salt, nb::object lora_name) {
                Pages p;
                p.ids = tuple_of(ids);
                p.n = p.ids.size();
                p.tokens = read_tokens(token_ids);
                p.page_size = page_size;
                p.bigram = bigram;
                p.parent = parent_id;
                p.events = event_hashes.has_value();
                if (p.events) {
                    if (event_hashes->size() != p.n) throw nb::value_error("event_hashes: one per page");
                    p.event_hash = std::move(*event_hashes);
                    p.event_parent = event_parent;
                }
                p.cache_salt = p.events ? cache_salt : nb::none();
                p.lora_name = p.events ? lora_name : nb::none();
                check_tokens(p);
                new (self) Pages(std::move(p));
            },
            nb::arg("ids"), nb::arg("token_ids"), nb::arg("page_size"), nb::arg("parent_id") = nb::none(),
            nb::arg("bigram") = false, nb::arg("event_hashes") = nb::none(), nb::arg("event_parent") = nb::none(),
            nb::arg("cache_salt") = nb::none(), nb::arg("lora_name") = nb::none(),
            nb::sig("def __init__(self, ids: collections.abc.Sequence[str], token_ids: collections.abc.Sequence[int], "
                    "page_size: int, parent_id: str | None = None, bigram: bool = False, "
                    "event_hashes: collections.abc.Sequence[int] | None = None, event_parent: int | None = None, "
                    "cache_salt: str | None = None, lora_name: str | None = None) -> None"))
        .def("__len__", [](const Pages &p) { return p.n; })
        .def_prop_ro("ids", [](const Pages &p) { return p.ids; }, nb::sig("def ids(self) -> tuple[str, ...]"))
        .def_prop_ro("page_size", [](const Pages &p) { return p.page_size; })
        .def_prop_ro("start", [](const Pages &p) { return p.start; },
                     "Where ``describe`` found the node on its inserted key, in pages (0 for other records).")
        .def_prop_ro("bigram", [](const Pages &p) { return p.bigram; })
        .def_prop_ro("events", [](const Pages &p) { return p.events; })
        .def("page", [](nb::handle self, size_t i) { return view(self, i); }, nb::arg("index"))
        .def(
            "views",
            [](nb::handle self, nb::handle positions) {
                nb::list out;
                if (positions.is_none()) {
                    for (size_t i = 0, n = nb::inst_ptr<Pages>(self)->n; i < n; ++i) out.append(view(self, i));
                    return out;
                }
                for (nb::handle i : tuple_of(positions)) out.append(view(self, nb::cast<size_t>(i)));
                return out;
            },
            nb::arg("positions") = nb::none(),
            nb::sig("def views(self, positions: collections.abc.Sequence[int] | None = None) -> list[Page]"),
            "A view of each page at ``positions`` (all by default), made in one call.")
        .def(
            "with_events",
            [](const Pages &p, std::vector<int64_t> hashes, std::optional<int64_t> parent, nb::object cache_salt,
               nb::object lora_name) {
                if (hashes.size() != p.n) throw nb::value_error("event_hashes: one per page");
                Pages out = p;
                out.events = true;
                out.event_hash = std::move(hashes);
                out.event_parent = parent;
                out.cache_salt = cache_salt;
                out.lora_name = lora_name;
                return out;
            },
            nb::arg("event_hashes"), nb::arg("event_parent").none(), nb::arg("cache_salt").none(),
            nb::arg("lora_name").none(),
            nb::sig("def with_events(self, event_hashes: collections.abc.Sequence[int], event_parent: int | None, "
                    "cache_salt: str | None, lora_name: str | None) -> Pages"),
            "The same pages with these KV-event ids (keys SGLang namespaces).");

    nb::class_<Page>(m, "Page", "Page ``index`` of a ``Pages`` record: what a tier keeps about a page.")
        .def_prop_ro("pages", [](const Page &p) { return p.owner; }, nb::sig("def pages(self) -> Pages"))
        .def_ro("index", &Page::index)
        .def_prop_ro("block_id", &Page::block_id, nb::sig("def block_id(self) -> str"))
        .def_prop_ro("parent_id", &Page::parent_id, nb::sig("def parent_id(self) -> str | None"),
                     "The block id of the page before this one in its sequence (None for a first page).")
        .def_prop_ro("token_ids", &Page::token_ids, nb::sig("def token_ids(self) -> tuple[int, ...]"),
                     "Its token ids (one more for an EAGLE bigram page).")
        .def_prop_ro("event_hash", &Page::event_hash, "Its KV-event block hash (None: not announced).")
        .def_prop_ro("event_parent", &Page::event_parent, "Its parent's KV-event block hash.")
        .def_prop_ro("cache_salt", [](const Page &p) { return p.pages->cache_salt; },
                     nb::sig("def cache_salt(self) -> str | None"))
        .def_prop_ro("lora_name", [](const Page &p) { return p.pages->lora_name; },
                     nb::sig("def lora_name(self) -> str | None"))
        .def_prop_ro("bigram", [](const Page &p) { return p.pages->bigram; })
        .def("__eq__", [](const Page &a, nb::handle b) {
            const Page *other = nullptr;
            return nb::try_cast<const Page *>(b, other) && other && equal(a, *other);
        }, nb::sig("def __eq__(self, other: object, /) -> bool"))
        .def("__hash__", [](const Page &p) { return nb::hash(p.block_id()); })
        .def("__repr__", [](const Page &p) {
            return nb::str("Page({!r}, parent={!r}, event={!r})")
                .format(p.block_id(), p.parent_id(), p.event_hash() ? nb::object(nb::int_(*p.event_hash())) : nb::none());
        });

    m.def("describe", &describe, nb::arg("tokens"), nb::arg("length"), nb::arg("page_size"), nb::arg("bigram"),
          nb::arg("seed").none(), nb::arg("keys"), nb::arg("events"),
          nb::sig("def describe(tokens: collections.abc.Sequence[int], length: int, page_size: int, bigram: bool, "
                  "seed: bytes | None, keys: collections.abc.Sequence[str], events: bool) -> Pages"),
          "The record of a node whose storage keys are ``keys``, from the key it was inserted with (``tokens``, "
          "``length`` tokens in full pages, chained from ``seed``); PageIdentityError if the keys are not on it. "
          "Hashes without the GIL. ``events``: the KV-event ids are the keys' (keys SGLang does not namespace).");
    m.def("stored_run", &stored_run, nb::arg("pages"),
          nb::sig("def stored_run(pages: collections.abc.Sequence[Page]) -> "
                  "tuple[list[int], int | None, list[int], str | None, str | None] | None"),
          "One BlockStored's fields for pages that form one chain of one namespace, else None.");
    m.def("unchained", &unchained, nb::arg("pages"),
          nb::sig("def unchained(pages: collections.abc.Sequence[Page]) -> list[int]"),
          "Positions of the pages whose parent is not the page before them (the first always).");
    m.def("event_hashes", &event_hashes, nb::arg("pages"),
          nb::sig("def event_hashes(pages: collections.abc.Sequence[Page]) -> list[int]"),
          "The KV-event block hashes of the pages that have one.");
    m.def("sha256_impl", [] { return sha256::best() == sha256::compress_portable ? "portable" : "x86-sha"; });
    m.def(
        "sha256",
        [](nb::bytes data, bool portable) {
            sha256::Hasher h(portable ? sha256::compress_portable : sha256::best());
            h.update(data.c_str(), data.size());
            auto d = h.finish();
            return nb::bytes(reinterpret_cast<const char *>(d.data()), d.size());
        },
        nb::arg("data"), nb::arg("portable") = false, "SHA-256 of ``data`` (for tests: either implementation).");
}

}  // namespace kvbm
