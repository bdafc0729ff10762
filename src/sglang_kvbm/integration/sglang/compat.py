"""Everything that differs between the SGLang releases this library supports, found by looking, in one place.

The rest of the library is written against one contract (SGLang 0.5.23's linker
seam); this module reads what the installed SGLang's classes have and says how
to meet that contract on it. No version strings are compared here: the range
itself is ``base.versions``, checked before this module is imported.

What was read (paths under ``sglang/srt/mem_cache/``):

======================  ======================  ======================  ======================
feature                 0.5.21                  0.5.22                  0.5.23
======================  ======================  ======================  ======================
route                   radix-cache factory     radix-cache factory     linker config flag
refusable loads         no (``load`` False      yes                     yes
                        raises; the tail joins
                        the tree before the
                        copy; completions by
                        ``pop_completed_load``;
                        ``init_load_back``
                        None keeps a request
                        waiting: ``lookup_pins``)
Mamba components        no                      no                      yes
draft KV pools          no                      no                      yes
SWA retain window       = the sliding window    = the sliding window    its own property
LoRA names on events    no                      ``LoRANameTable``       ``KvEventLoraNames``
Dynamo event format     no                      yes                     yes
offload-ready events    no                      no                      yes
======================  ======================  ======================  ======================

**Route.** 0.5.23 builds any linker named by ``--unified-cache-external-linker-config``
(backend ``dynamic``), and refuses that flag beside ``--radix-cache-backend``:
there ``--radix-cache-backend kvbm`` is rewritten into it (``flags``). 0.5.21 and
0.5.22 build only their Mooncake and MORI linkers, and do not refuse the two
flags together: there ``kvbm`` stays the radix-cache backend, its factory
(``factory``) builds SGLang's default tree with this linker attached, as
SGLang's own ``create_unified_radix_cache`` attaches its linkers, and
``--enable-unified-cache-external-linker`` is turned on so the scheduler polls
the tree and starts its layer-wise loads.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Seam:
    linker_config_flag: bool  # --unified-cache-external-linker-config and the `dynamic` backend exist
    refusable_loads: bool  # load() may answer False, and finish_layer_wise_loading reports a failed batch
    mamba: bool  # the tree hands Mamba components to a linker
    draft_pools: bool  # CacheInitParams.sidecar_draft_device_pools (EAGLE draft KV beside the target's)
    retain_window: bool  # CacheInitParams.swa_retain_window (the draft's SWA window counted)
    event_lora_names: bool  # BlockStored.lora_name and the recorder's lora_names
    event_dynamo_format: bool  # the recorder's dynamo_format
    offload_ready: bool  # UnifiedCacheLinker.record_offload_ready (CUDA: the scheduler's and forward's events)

    @property
    def first_version_with(self) -> dict:
        """Which release first has each feature this SGLang lacks (for refusals)."""
        return FIRST_VERSION_WITH


FIRST_VERSION_WITH = {"refusable_loads": "0.5.22", "mamba": "0.5.23", "draft_pools": "0.5.23",
                      "event_lora_names": "0.5.22", "event_dynamo_format": "0.5.22"}


@functools.lru_cache(maxsize=None)
def seam() -> Seam:
    from sglang.srt.disaggregation.kv_events import BlockStored
    from sglang.srt.mem_cache import cache_init_params
    from sglang.srt.mem_cache.events import KVCacheEventRecorder
    from sglang.srt.mem_cache.unified_cache import unified_cache_linker as linker
    from sglang.srt.server_args import ServerArgs

    params = {f.name for f in dataclasses.fields(cache_init_params.CacheInitParams)}
    recorder = inspect.signature(KVCacheEventRecorder.__init__).parameters
    supported = getattr(linker, "_EXTERNAL_LINKER_SUPPORTED_COMPONENTS", None)
    base = linker.UnifiedCacheLinker
    return Seam(
        linker_config_flag="unified_cache_external_linker_config" in ServerArgs.__struct_fields__,
        refusable_loads=hasattr(base, "finish_layer_wise_loading"),
        mamba=supported is None or any(c.name == "MAMBA" for c in supported),
        draft_pools="sidecar_draft_device_pools" in params,
        retain_window=isinstance(getattr(cache_init_params.CacheInitParams, "swa_retain_window", None), property),
        event_lora_names="lora_name" in getattr(BlockStored, "__struct_fields__", ()),
        event_dynamo_format="dynamo_format" in recorder,
        offload_ready=hasattr(base, "record_offload_ready"),
    )


# -- what CacheInitParams holds, on every release ------------------------------------------------------------


def event_format(params) -> tuple[bool, Any]:
    """``(dynamo_format, lora_names)`` of the worker's event recorder (absent fields: off and none)."""
    return bool(getattr(params, "dynamo_kv_event_format", False)), getattr(params, "kv_event_lora_names", None)


def draft_pools(params) -> tuple:
    """Every draft KV pool sharing the target's token slots (EAGLE sidecars and MTP layers)."""
    return tuple(getattr(params, "sidecar_draft_device_pools", ())) + tuple(getattr(params, "mtp_draft_device_pools", ()))


def mtp_draft_mamba_pools(params) -> tuple:
    """MTP draft Mamba states (0.5.22 on; refused on every release: ``pool_group``)."""
    return tuple(getattr(params, "mtp_draft_mamba_pools", ()))


def swa_retain_window(params) -> Optional[int]:
    """How much sliding-window history every reader needs: SGLang's own property, else the window itself (a release
    without the property has no draft SWA window to add)."""
    if seam().retain_window:
        return params.swa_retain_window
    return params.sliding_window_size


def lora_name_table(lora_refs=None):
    """An empty (or filled) table of adapter names for events, of the type this SGLang's recorder takes; None where
    its events carry no adapter names."""
    from sglang.srt.mem_cache import events

    table = getattr(events, "KvEventLoraNames", None) or getattr(events, "LoRANameTable", None)
    if table is None:
        return None
    return table.from_lora_refs(lora_refs) if lora_refs else table()


# -- events -------------------------------------------------------------------------------------------------


def event_recorder(*, enabled: bool, page_size: int, dynamo_format: bool = False, lora_names=None):
    """SGLang's ``KVCacheEventRecorder`` with what this release's takes."""
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    kwargs: dict = {}
    if seam().event_dynamo_format:
        kwargs["dynamo_format"] = dynamo_format
    if seam().event_lora_names:
        kwargs["lora_names"] = lora_names
    return KVCacheEventRecorder(enabled=enabled, page_size=page_size, **kwargs)


def block_stored(**fields):
    """SGLang's ``BlockStored``; ``lora_name`` only where the wire has it (always None there otherwise: refused)."""
    from sglang.srt.disaggregation.kv_events import BlockStored

    if not seam().event_lora_names:
        fields.pop("lora_name", None)
    return BlockStored(**fields)


def event_lora_name(event) -> Optional[str]:
    return getattr(event, "lora_name", None)


# -- CUDA -----------------------------------------------------------------------------------------------------


def offload_ready_events(forward_stream) -> list:
    """What 0.5.23's ``UnifiedCacheLinker.record_offload_ready`` records, for releases whose base lacks it: an event
    on the current (scheduler's) stream, and one on the forward's stream, which may still write the pages."""
    import torch

    events = [torch.cuda.Event()]
    events[0].record()
    if forward_stream is not None:
        events.append(torch.cuda.Event())
        events[1].record(forward_stream)
    return events


# -- refusals ------------------------------------------------------------------------------------------------


def refuse_what_this_sglang_cannot_carry(server_args, params, components) -> None:
    """Start-up: a feature this release's seam cannot carry is refused, naming the release that has it.

    Never half-served: a Mamba state, a draft model's KV or an adapter's name
    that this SGLang does not hand the linker would be missing from every block.
    """
    from importlib import metadata

    from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError

    have = seam()
    installed = metadata.version("sglang")
    first = have.first_version_with

    def refuse(what: str, feature: str) -> None:
        raise UnsupportedPoolError(
            f"sglang {installed} does not hand {what} to an external cache; sglang-kvbm can store it with sglang "
            f">={first[feature]}: pip install 'sglang>={first[feature]},<0.6', or run without --radix-cache-backend "
            f"kvbm"
        )

    names = {getattr(c, "name", str(c)) for c in components}
    if "MAMBA" in names and not have.mamba:
        refuse("a Mamba model's state", "mamba")
    speculative = getattr(server_args, "speculative_algorithm", None) if server_args is not None else None
    if speculative and not have.draft_pools:
        refuse(f"the draft KV of --speculative-algorithm {speculative}", "draft_pools")
    if "SWA" in names and not have.refusable_loads:
        # A sliding-window page the host tier lets go of between lookup and load could not be refused there.
        refuse("a sliding-window model's load in a form a linker may decline", "refusable_loads")
    lora = server_args is not None and getattr(server_args, "enable_lora", False)
    if lora and params.enable_kv_cache_events and not have.event_lora_names:
        refuse("adapter names on KV events (--enable-lora with --kv-events-config)", "event_lora_names")


# -- for servers that build SGLang's pools themselves (``custom``, the tests) ---------------------------------


def cache_init_params(**fields):
    """SGLang's ``CacheInitParams``, leaving out fields this release lacks when they hold their default (off or
    empty); one set to anything else is refused, naming it."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    known = {f.name for f in dataclasses.fields(CacheInitParams)}
    for name in [name for name in fields if name not in known]:
        if fields[name]:
            raise TypeError(f"this SGLang's CacheInitParams has no {name!r} (set to {fields[name]!r})")
        del fields[name]
    return CacheInitParams(**fields)


def loaded_tail(result) -> tuple[int, Optional["torch.Tensor"]]:
    """``UnifiedRadixCache.init_load_back``'s answer as ``(tokens loaded, their slots)``: slots only where the tree
    holds the loaded tail already, its copy still running (0.5.21); None where the caller inserts it after the copy."""
    loaded, _ = result
    if seam().refusable_loads:
        return loaded, None
    return len(loaded), (loaded if len(loaded) else None)


def admit_match(req, match) -> None:
    """What ``init_load_back`` reads off a request after its match, as the scheduler sets it: the matched device
    node, and on releases whose match carries the device indices (0.5.21) the prefix the load goes after."""
    req.last_node = match.last_device_node
    indices = getattr(match, "device_indices", None)
    if indices is not None:
        req.prefix_indices = indices


def device_prefix_len(match) -> int:
    """Tokens of a ``MatchResult`` found in the device pool (0.5.21 gives their indices only)."""
    length = getattr(match, "device_prefix_len", None)
    return int(length) if length is not None else int(match.device_indices.numel())


def path_device_indices(tree, node) -> "torch.Tensor":
    """Device token slots from the root of ``tree`` (a ``UnifiedRadixCache``) to ``node``, in order."""
    if hasattr(tree, "path_device_indices"):
        return tree.path_device_indices(node)
    return tree.tree_core.collect_full_device_indices(node, tree.tree_core.root_node_handle())
