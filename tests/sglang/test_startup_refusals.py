"""What the linker refuses at start-up, each with the reason, and what a closed cache leaves behind."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import sglang_kvbm.integration.sglang.linker  # noqa: F401  (see test_a_closed_cache_is_collected_with_its_slab)
from conftest import SEAM, build_stack, needs
from sglang_kvbm.config import ConfigError
from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError, paged_layout


@pytest.mark.parametrize("recipe, scales", [("fp8", 0), ("fp4", 2), ("nvfp4", 2)])
def test_quantized_kv_pools_page_their_scales_with_their_kv(recipe, scales):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from conftest import quant_method

    pool = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 64, 3, "cpu", False, quant_method=quant_method(recipe, 3, 4))
    assert pool.is_quantized_kv_cache
    layout = paged_layout(pool, 4)
    assert len(layout.buffer_page_bytes) == 3 * (2 + scales)
    for layer, buffers in enumerate(layout.layers):  # each layer loads its K, V and their scales together
        assert len(buffers) == 2 + scales and buffers[:2] == (layer, 3 + layer)


def test_page_major_native_fp4_scales_are_refused():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from conftest import quant_method

    pool = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 64, 2, "cpu", False,
                            quant_method=quant_method("nvfp4", 2, 4, native_scales=True))
    assert pool.native_k_scale_buffer is not None
    with pytest.raises(UnsupportedPoolError, match="native FP4 scales"):
        paged_layout(pool, 4)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (dict(disable_radix_cache=True), "--disable-radix-cache"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
        (dict(hicache_storage_backend="file"), "--hicache-storage-backend"),
        pytest.param(dict(unified_cache_external_linker_config={"linker": "Other", "linker_module_path": "x"}),
                     "--unified-cache-external-linker-config", marks=needs("linker_config_flag")),
    ],
)
def test_conflicting_cache_flags_stop_the_launcher(flags, needle, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    from sglang_kvbm.integration.sglang.flags import translate

    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "1")
    args = ServerArgs(model_path="dummy", radix_cache_backend="kvbm", **flags)
    with pytest.raises(ConfigError, match=needle):
        translate(args)


@needs("linker_config_flag")
def test_the_flag_becomes_the_linker_on_the_default_tree(monkeypatch):
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs

    from sglang_kvbm.integration.sglang.flags import translate

    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "1")
    args = ServerArgs(model_path="dummy", radix_cache_backend="kvbm")
    translate(args)
    view = resolving_view(args)
    assert view.radix_cache_backend is None and view.enable_unified_cache_external_linker
    assert view.unified_cache_external_linker_backend == "dynamic"
    assert view.unified_cache_external_linker_config["linker"] == "KvbmLinker"


@pytest.mark.skipif(SEAM.linker_config_flag, reason="this SGLang builds linkers from --unified-cache-external-linker-config")
def test_where_sglang_builds_only_its_own_linkers_the_kvbm_factory_stays_with_the_linker_hooks_on(monkeypatch):
    """SGLang 0.5.21 and 0.5.22: the radix-cache factory attaches the linker (``factory``); the scheduler's linker
    hooks (per-step poll, layer-wise loading) are on."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.server_args import ServerArgs

    from sglang_kvbm.integration.sglang import plugin
    from sglang_kvbm.integration.sglang.flags import describe, translate

    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "1")
    args = ServerArgs(model_path="dummy", radix_cache_backend="kvbm")
    translate(args)
    view = resolving_view(args)
    assert view.radix_cache_backend == "kvbm" and view.enable_unified_cache_external_linker
    plugin.register()
    assert get_radix_cache_factory("kvbm") is plugin._build_tree
    assert describe() == "--radix-cache-backend kvbm --enable-unified-cache-external-linker"


UNSUPPORTED = """
from importlib import metadata

real = metadata.version
metadata.version = lambda name: "0.5.20" if name == "sglang" else real(name)
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args

load_plugins()
prepare_server_args(["--model-path", "dummy"]).resolve_once()
print("resolved without kvbm")
prepare_server_args(["--model-path", "dummy", "--radix-cache-backend", "kvbm"]).resolve_once()
"""


def test_an_sglang_outside_the_range_is_refused_in_one_line_only_when_kvbm_is_asked_for():
    """SGLang's own plugin loading and resolution pipeline, in a process of its own told it is 0.5.20 (no linker
    seam; its wheel has the same resolution step): a server without kvbm resolves; with it, the launcher stops with
    the range and the fix before reading a cache flag. (Other versions: test_doctor's check_sglang_version cases.)"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", UNSUPPORTED], capture_output=True, text=True, timeout=600)
    assert "resolved without kvbm" in run.stdout, run.stderr[-2000:]
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_kvbm.base.values.ConfigError: ") and "sglang 0.5.20 is installed" in last
    assert ">=0.5.21,<0.6" in last and "pip install 'sglang>=0.5.21,<0.6'" in last


def test_no_tier_stops_the_launcher(monkeypatch):
    from sglang.srt.server_args import ServerArgs

    from sglang_kvbm.integration.sglang.flags import translate

    for name in ("DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "DYN_KVBM_DISK_CACHE_GB",
                 "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="DYN_KVBM_CPU_CACHE_GB"):
        translate(ServerArgs(model_path="dummy", radix_cache_backend="kvbm"))


def test_a_closed_cache_is_collected_with_its_slab():
    """No atexit or other global keeps a closed cache (and its pinned host slab) alive.

    SGLang's first import of its model worker module keeps the importing frames
    alive for good (measured: pkgutil.resolve_name of a tp_worker attribute pins
    its caller's locals once per process); the linker module makes that import
    when it is imported, which this file does at module level, so no cache is
    on the stack then.
    """
    stack = build_stack()
    stack.insert(list(range(16)), seed=1)
    stack.settle()
    linker = weakref.ref(stack.linker)
    slab = weakref.ref(stack.manager.host.slab)
    stack.cache.close()
    del stack
    gc.collect()
    assert linker() is None and slab() is None


@pytest.mark.parametrize("endpoint,warned", [("tcp://127.0.0.1:5557", True), ("tcp://*:5557", False)])
def test_under_dynamo_a_non_wildcard_events_host_is_warned_about(endpoint, warned, monkeypatch, caplog):
    import sys
    import types

    from sglang_kvbm.integration.dynamo.worker import warn_if_dynamo_will_not_connect

    monkeypatch.delenv("SGLANG_HOST_IP", raising=False)
    monkeypatch.delitem(sys.modules, "dynamo.sglang", raising=False)  # Dynamo's environment may have imported it
    events = {"publisher": "zmq", "endpoint": endpoint, "bind": True}
    warn_if_dynamo_will_not_connect(events)  # plain SGLang: nothing to say
    assert "subscribe at this machine's IP" not in caplog.text
    monkeypatch.setitem(sys.modules, "dynamo.sglang", types.ModuleType("dynamo.sglang"))
    warn_if_dynamo_will_not_connect(events)
    assert ("subscribe at this machine's IP" in caplog.text) is warned
    if warned:
        assert "tcp://*:5557" in caplog.text and "SGLANG_HOST_IP=127.0.0.1" in caplog.text


@needs("mamba")  # its hybrid pools are built as 0.5.23 builds them (harness.hybrid); older releases: test below
def test_what_the_seam_cannot_carry_is_refused_with_the_reason(tmp_path):
    """A sliding-window hybrid's draft pools (split into full and window slots) and hybrids under context
    parallelism: refused at start-up, naming what to change."""
    import dataclasses

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from harness.hybrid import build
    from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError
    from sglang_kvbm.integration.sglang.pool_group import describe_pools

    h = build("swa", tmp_path)
    params = h.cache.cache_init_params
    draft = MHATokenToKVPool(512, 1, torch.float32, 2, 8, 1, "cpu", False)
    components = set(h.cache.components)
    with pytest.raises(UnsupportedPoolError, match="draft KV of a sliding-window hybrid"):
        describe_pools(dataclasses.replace(params, sidecar_draft_device_pools=(draft,)), components)
    with pytest.raises(UnsupportedPoolError, match="context parallelism"):
        describe_pools(dataclasses.replace(params, attn_cp_size=2), components)
    assert [s.name for s in describe_pools(params, components).sidecars] == ["swa"]


@pytest.mark.skipif(SEAM.mamba and SEAM.draft_pools and SEAM.refusable_loads, reason="this SGLang carries them all")
def test_what_this_sglang_cannot_hand_a_linker_is_refused_naming_the_release_that_can():
    """0.5.21/0.5.22: Mamba state, a draft model's KV, (0.5.21) sliding-window loads, LoRA names on events."""
    import types

    from sglang_kvbm.integration.sglang.compat import refuse_what_this_sglang_cannot_carry
    from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError

    params = types.SimpleNamespace(enable_kv_cache_events=True)
    plain = types.SimpleNamespace(speculative_algorithm=None, enable_lora=False)
    refuse_what_this_sglang_cannot_carry(plain, params, [types.SimpleNamespace(name="FULL")])  # nothing to refuse
    cases = [("MAMBA", plain, "Mamba", "0.5.23", not SEAM.mamba),
             ("FULL", types.SimpleNamespace(speculative_algorithm="EAGLE", enable_lora=False), "draft KV", "0.5.23",
              not SEAM.draft_pools),
             ("SWA", plain, "sliding-window", "0.5.22", not SEAM.refusable_loads),
             ("FULL", types.SimpleNamespace(speculative_algorithm=None, enable_lora=True), "adapter names", "0.5.22",
              not SEAM.event_lora_names)]
    for component, args, what, release, refused in cases:
        if not refused:
            continue
        with pytest.raises(UnsupportedPoolError, match=f"{what}.*sglang>={release}"):
            refuse_what_this_sglang_cannot_carry(args, params, [types.SimpleNamespace(name=component)])
