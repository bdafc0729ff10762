"""Which boundaries sidecar pools can restore, and how their offloads complete with the KV's.

Real ``LocalBlockManager`` host tiers (one per sidecar pool, as the linker builds
them); blocks are stored by id through the same path the linker's offloads take.
"""

from __future__ import annotations

import hashlib
import random

import torch

from sglang_kvbm.core.pages import one_page
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.manager.sidecars import SidecarStores
from sglang_kvbm.transfer.kv_layout import PagedKvLayout


def bid(name: str) -> str:
    """A block id as SGLang makes them (a hex sha256 digest), named for the test."""
    return hashlib.sha256(name.encode()).hexdigest()


def manager(pages: int = 64, host: int = 0) -> LocalBlockManager:
    layout = PagedKvLayout([torch.randn(pages, 16)], 1)
    return LocalBlockManager(layout, host or pages)


def store(stores: SidecarStores, held: dict[str, list[str]]) -> None:
    requests = {}
    for name, ids in held.items():
        if ids:
            requests[name] = StoreRequest(tuple(ids), torch.arange(len(ids)), lambda pos, ids=ids: [one_page(ids[i]) for i in pos])
    stores.store(requests)
    for m in stores.managers.values():
        assert m.wait(10)
    assert stores.completed() == 1 and stores.pop()


def test_the_longest_boundary_is_the_last_of_every_restorable_one():
    rng = random.Random(3)
    for trial in range(200):
        windows = {"swa": rng.randint(1, 5), "mamba": 1} if trial % 2 else {"swa": rng.randint(1, 5)}
        stores = SidecarStores({name: (manager(), w) for name, w in windows.items()})
        keys = [bid(f"k{trial}-{i}") for i in range(rng.randint(1, 40))]
        density = rng.random()
        store(stores, {name: [k for k in keys if rng.random() < density] for name in windows})
        hit = rng.randint(1, len(keys))
        every = stores.restorable(keys, hit, every=True)
        longest = stores.restorable(keys, hit)
        assert longest == every[-1:], (windows, hit, every, longest)
        for p in every:  # each one really has every sidecar's window
            for name, ids in stores.parts(keys, p).items():
                assert all(stores.managers[name].servable(ids)) and len(ids) == min(p, windows[name])
        stores.close()


def test_an_offload_completes_when_every_part_did_and_fails_if_one_failed():
    stores = SidecarStores({"swa": (manager(8, host=4), 2)})
    store(stores, {"swa": [bid("a"), bid("b")]})
    stores.store({})  # an offload without sidecar parts completes at once
    assert stores.completed() == 1 and stores.pop()
    too_many = [bid(f"x{i}") for i in range(6)]  # more blocks than the host tier holds: the part fails
    stores.store({"swa": StoreRequest(tuple(too_many), torch.arange(6), lambda pos: [one_page(too_many[i]) for i in pos])})
    stores.managers["swa"].wait(10)
    assert stores.completed() == 1 and stores.pop() is False
    stores.close()
