"""Page identity equals SGLang's own: its hash extension, its tree's hashes, its event ids."""

import random
from array import array

import pytest
from sglang.srt.disaggregation.kv_events import BlockStored
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from conftest import chain_links
from sglang_kvbm.core.identity import chain_hashes, event_id, namespace_seed, page_hashes


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chain_matches_sglang_native_hash(page_size):
    rng = random.Random(page_size)
    tokens = [rng.randrange(0, 150_000) for _ in range(page_size * 9)]
    assert page_hashes(tokens, page_size) == get_hash_str(tokens, None, page_size=page_size)
    prior = page_hashes(tokens[:page_size], page_size)[0]
    assert page_hashes(tokens[page_size:], page_size, prior) == get_hash_str(tokens[page_size:], prior, page_size)


@pytest.mark.parametrize("extra_key, cache_salt", [("lora-x", None), (None, "salt"), ("k", "s")])
def test_namespaced_chain_matches_sglang_storage_hash(extra_key, cache_salt):
    tokens = list(range(40))
    key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
    assert chain_hashes(tokens, 4, extra_key=extra_key, cache_salt=cache_salt) == get_storage_hash_str(
        key, None, page_size=4
    )
    assert namespace_seed(extra_key, cache_salt) != namespace_seed(None, None)


def test_partial_last_page_is_not_a_block():
    assert len(page_hashes(list(range(10)), 4)) == 2


def test_ids_equal_the_tree_and_its_gpu_events():
    """The ids SGLang's RadixCache publishes for a page are the ones this library computes."""
    tree = RadixCache.create_simulated(page_size=4, enable_kv_cache_events=True)
    tokens = list(range(100, 124))
    tree.insert(InsertParams(key=RadixKey(array("q", tokens[:8]))))
    tree.insert(InsertParams(key=RadixKey(array("q", tokens))))
    events = [e for e in tree.take_events() if isinstance(e, BlockStored)]
    published = [h for e in events for h in e.block_hashes]
    ours = chain_hashes(tokens, 4)
    assert published == [event_id(h) for h in ours]
    ids = [event_id(h) for h in ours]
    assert chain_links(events) == list(zip([None] + ids[:-1], ids))
    node = tree.root_node.children[tuple(tokens[:4])].children[tuple(tokens[8:12])]
    assert node.hash_value == ours[2:]
