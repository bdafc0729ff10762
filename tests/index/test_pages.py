"""Page records (``csrc/pages.h``): SGLang's storage hash bit for bit, the node found and checked on its key,
the records' fields, and what they refuse.

The comparison with SGLang's own hash (``get_storage_hash_str``, the C++ extension SGLang runs) needs SGLang
and is skipped without it (the installed-wheel check); the rest needs only the index.
"""

import hashlib
import random
from array import array

import blocks_under_test  # noqa: F401 - the build under test, before the index
import pytest

from sglang_kvbm import _blocks
from sglang_kvbm._blocks import PageIdentityError, Pages, describe, event_hashes, stored_run, unchained
from sglang_kvbm.core.identity import chain_hashes, event_id, namespace_seed
from sglang_kvbm.core.pages import bare_pages, one_page


@pytest.mark.parametrize("portable", [False, True])
def test_sha256_is_hashlibs_for_every_length(portable):
    rng = random.Random(0)
    for n in [*range(0, 200), 1000, 4096, 65537]:
        data = rng.randbytes(n)
        assert _blocks.sha256(data, portable) == hashlib.sha256(data).digest(), n
    assert _blocks.sha256_impl() in ("x86-sha", "portable")


def _key(rng, page, *, wide=False, bigram=False):
    n = rng.randint(1, 24) * page
    top = 1 << 40 if wide else 50_000
    return [rng.randrange(top if rng.random() < 0.2 else 50_000) for _ in range(n + bigram)], n


def _check(record, chain, tokens, page, start, count, bigram, events=True):
    assert record.ids == tuple(chain[start : start + count]) and len(record) == count and record.start == start
    views = record.views()
    assert [v.block_id for v in views] == chain[start : start + count]
    assert views[0].parent_id == (chain[start - 1] if start else None)
    assert [v.parent_id for v in views[1:]] == chain[start : start + count - 1]
    for j, view in enumerate(views):
        at = (start + j) * page
        assert view.token_ids == tuple(tokens[at : at + page + bigram])
        if events:
            assert view.event_hash == event_id(chain[start + j])
            assert view.event_parent == (event_id(chain[start + j - 1]) if start + j else None)
        else:
            assert view.event_hash is None and view.event_parent is None


@pytest.mark.parametrize("page", [1, 16, 64])
def test_the_record_of_a_node_is_sglangs_storage_hash_of_its_key(page):
    """Random keys (namespaced, EAGLE bigram, ids above uint32, lists and arrays): the node found where SGLang's
    own hash puts it, every key checked, tokens, parents and event ids as SGLang computes them."""
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    rng = random.Random(page)
    for trial in range(60):
        bigram, wide = trial % 3 == 0, trial % 5 == 0
        extra_key = "adapter" if trial % 4 == 0 else None
        salt = "tenant" if trial % 7 == 0 else None
        tokens, n = _key(rng, page, wide=wide, bigram=bigram)
        raw = array("q", tokens) if trial % 2 else list(tokens)
        key = RadixKey(raw, extra_key, cache_salt=salt, is_bigram=bigram)
        chain = get_storage_hash_str(key, None, page_size=page)
        seed = namespace_seed(extra_key, salt)
        start = rng.randrange(len(chain))
        count = rng.randint(1, len(chain) - start)
        record = describe(raw, n, page, bigram, bytes.fromhex(seed) if seed else None, chain[start : start + count],
                          trial % 2 == 0)
        _check(record, chain, tokens, page, start, count, bigram, events=trial % 2 == 0)


def test_the_record_matches_the_specification_without_sglang():
    rng = random.Random(1)
    for page in (1, 4, 16):
        tokens, n = _key(rng, page)
        chain = chain_hashes(tokens, page)
        for start in (0, len(chain) // 2, len(chain) - 1):
            record = describe(tokens, n, page, False, None, chain[start:], True)
            _check(record, chain, tokens, page, start, len(chain) - start, False)


def test_keys_not_on_the_inserted_key_are_refused():
    tokens = list(range(64))
    chain = chain_hashes(tokens, 4)
    other = chain_hashes([t + 1 for t in tokens], 4)
    for keys, why in [
        (other[3:5], "not on the inserted key's path"),
        (chain[3:5][::-1], "do not follow"),
        ([chain[3], other[4]], "do not follow"),
        (chain[14:] + other[:1], "run past"),
        (["zz" * 32], "not on the inserted key's path"),
        ([chain[3].upper()], "not on the inserted key's path"),
        ([], "not on the inserted key's path"),
    ]:
        with pytest.raises(PageIdentityError, match=why):
            describe(tokens, 64, 4, False, None, keys, True)
    with pytest.raises(PageIdentityError):  # the seed starts another chain
        describe(tokens, 64, 4, False, bytes(32), chain[:2], True)


@pytest.mark.parametrize("call, error", [
    (lambda c: describe(list(range(8)), 16, 4, False, None, c[:1], True), ValueError),  # shorter than length
    (lambda c: describe(list(range(16)), 16, 0, False, None, c[:1], True), ValueError),
    (lambda c: describe(list(range(16)), 16, 4, False, b"short", c[:1], True), ValueError),
    (lambda c: describe(list(range(16)), 16, 4, False, None, c[0], True), TypeError),  # one id, not a sequence
    (lambda c: describe(list(range(16)), 16, 4, False, None, [1, 2], True), PageIdentityError),
    (lambda c: describe(array("d", range(16)), 16, 4, False, None, c[:1], True), TypeError),
    (lambda c: describe(["a"] * 16, 16, 4, False, None, c[:1], True), TypeError),
    (lambda c: describe([-1] + list(range(15)), 16, 4, False, None, c[:1], True), ValueError),
    (lambda c: describe([1 << 70] * 16, 16, 4, False, None, c[:1], True), OverflowError),
])
def test_bad_input_is_an_error_not_a_crash(call, error):
    with pytest.raises(error):
        call(chain_hashes(list(range(16)), 4))


def test_token_ids_are_read_from_any_int_buffer_or_sequence():
    tokens = list(range(100, 132))
    chain = chain_hashes(tokens, 8)
    for given in (tokens, tuple(tokens), array("q", tokens), array("l", tokens), array("I", tokens),
                  array("i", tokens), array("Q", tokens), memoryview(array("q", tokens))):
        assert describe(given, 32, 8, False, None, chain[1:], False).ids == tuple(chain[1:])

    class Index:
        def __init__(self, value):
            self.value = value

        def __index__(self):
            return self.value

    assert describe([Index(t) for t in tokens], 32, 8, False, None, chain, False).start == 0


def test_records_built_from_python_check_their_shape():
    with pytest.raises(ValueError, match="token_ids"):
        Pages(("a", "b"), (1, 2, 3), 2)
    with pytest.raises(ValueError, match="one per page"):
        Pages(("a",), (1, 2), 2, None, False, [1, 2])
    with pytest.raises(IndexError):
        Pages(("a",), (1, 2), 2).page(1)
    record = Pages(("a", "b"), (1, 2, 3, 4, 5), 2, "p", True, [10, 11], 9, "salt", "lora")
    a, b = record.views()
    assert (a.block_id, a.parent_id, a.token_ids, a.event_hash, a.event_parent) == ("a", "p", (1, 2, 3), 10, 9)
    assert (b.block_id, b.parent_id, b.token_ids, b.event_hash, b.event_parent) == ("b", "a", (3, 4, 5), 11, 10)
    assert (b.cache_salt, b.lora_name, b.bigram) == ("salt", "lora", True)
    bare = bare_pages(["x", "y"]).views([1])
    assert bare[0].block_id == "y" and bare[0].token_ids == () and bare[0].event_hash is None


def test_a_page_equals_the_same_page_however_it_was_made():
    tokens = list(range(12))
    chain = chain_hashes(tokens, 4)
    node = describe(tokens, 12, 4, False, None, chain, True).views()
    alone = one_page(chain[1], tokens[4:8], parent_id=chain[0], event_hash=event_id(chain[1]),
                     event_parent=event_id(chain[0]))
    assert node[1] == alone and hash(node[1]) == hash(alone)
    assert node[1] != one_page(chain[1], tokens[4:8], parent_id=chain[0])  # not announced
    assert node[1] != node[2] and node[1] != "x"


def test_stored_run_is_one_event_for_one_chain_of_one_namespace():
    tokens = list(range(16))
    chain = chain_hashes(tokens, 4)
    views = describe(tokens, 16, 4, False, None, chain, True).views()
    hashes, parent, flat, salt, lora = stored_run(views[1:])
    assert hashes == [event_id(c) for c in chain[1:]] and parent == event_id(chain[0])
    assert flat == tokens[4:] and (salt, lora) == (None, None)
    assert stored_run(views[::2]) is None  # not a chain
    assert stored_run([]) is None
    assert stored_run(describe(tokens, 16, 4, False, None, chain, False).views()) is None  # no events
    assert event_hashes(views + bare_pages(["x"]).views()) == [event_id(c) for c in chain]
    with pytest.raises(TypeError):
        stored_run(["not a page"])
    with pytest.raises(TypeError):
        event_hashes([None])


def test_unchained_names_each_page_whose_parent_is_not_the_page_before_it():
    tokens = list(range(24))
    chain = chain_hashes(tokens, 4)
    node = describe(tokens, 24, 4, False, None, chain, False)
    views = node.views()
    assert unchained(views) == [0]
    assert unchained(node.views([0, 1, 3, 4, 5])) == [0, 2]  # a gap: page 3's parent is not in the list
    assert unchained(views[2:] + views[:2]) == [0, 4]  # the wrap: page 0 does not follow page 5
    # The same pages made one by one: equal pages, but nothing says they chain, so each is looked up.
    alone = [one_page(chain[i], tokens[4 * i:4 * i + 4], parent_id=chain[i - 1] if i else None) for i in range(3)]
    assert alone == views[:3] and unchained(alone) == [0, 1, 2]
    assert unchained([]) == []
    with pytest.raises(TypeError):
        unchained([views[0], "not a page"])
    # Each listed page really is one whose parent is elsewhere; each other one's parent is the page before it.
    mixed = views[3:] + node.views([0, 1])
    listed = set(unchained(mixed))
    assert all((mixed[i].parent_id == mixed[i - 1].block_id) != (i in listed) for i in range(1, len(mixed)))


def test_views_keep_their_record_alive():
    tokens = list(range(8))
    views = describe(array("q", tokens), 8, 2, False, None, chain_hashes(tokens, 2), True).views([3, 0])
    del tokens
    assert [v.index for v in views] == [3, 0] and views[0].pages is views[1].pages
    assert views[0].token_ids == (6, 7)
