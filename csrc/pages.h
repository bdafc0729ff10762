// What a stored page is besides its bytes, in bulk: one record per node the tree offloads (``Pages``: block ids,
// token ids, the parent of its first page, KV-event ids), and a view of one page of it (``Page``) where a tier
// keeps a page: a host row's payload, a disk header's source, an event. A node of n pages is one record and n
// views made in one C++ call; nothing about a page is a Python object until someone asks for it.
//
// ``describe`` builds a node's record from the inserted key: it finds the node's pages on the key's storage-hash
// chain (SGLang's hash, page_hash.h) and checks every one, without the GIL.

#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace kvbm {

namespace nb = nanobind;

struct PageIdentityError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// One node's pages. Immutable once built (``with_events`` makes a new one).
struct Pages {
    nb::tuple ids;                // block ids (str), one per page
    size_t n = 0;                 // pages
    size_t start = 0;             // ``describe``: the page of the inserted key where the node begins
    std::vector<int64_t> tokens;  // n * page_size token ids, one more for bigram (EAGLE) pages
    size_t page_size = 0;
    bool bigram = false;
    nb::object parent;            // block id of the page before the first (str), or None
    bool events = false;          // the pages carry KV-event ids
    std::vector<int64_t> event_hash;
    std::optional<int64_t> event_parent;  // the first page's parent in events
    nb::object cache_salt, lora_name;     // None or str (events only)
};

// Page ``index`` of a record (holds the record's Python object).
struct Page {
    nb::object owner;
    const Pages *pages;
    size_t index;

    nb::object block_id() const { return pages->ids[index]; }
    nb::object parent_id() const { return index ? nb::object(pages->ids[index - 1]) : pages->parent; }
    nb::tuple token_ids() const;
    std::optional<int64_t> event_hash() const {
        return pages->events ? std::optional<int64_t>(pages->event_hash[index]) : std::nullopt;
    }
    std::optional<int64_t> event_parent() const {
        if (!pages->events) return std::nullopt;
        return index ? std::optional<int64_t>(pages->event_hash[index - 1]) : pages->event_parent;
    }
};

void bind_pages(nb::module_ &m);

}  // namespace kvbm
