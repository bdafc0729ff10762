"""The disk tier's identity: a block written by one model, revision, dtype or rank is never read by another.

Hub ids are resolved offline through a Hugging Face cache laid out in a temporary
directory, the way ``huggingface_hub`` stores downloads: ``snapshots/<commit>/``
holds symlinks into ``blobs/``, ``refs/main`` names the current commit.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from sglang_kvbm.integration.sglang.fingerprint import server_fingerprint

REV1 = "1" * 40
REV2 = "2" * 40
LAYOUT = types.SimpleNamespace(page_size=4, buffer_page_bytes=[1024, 1024])


class Pool:
    dtype = "torch.bfloat16"
    kv_cache_layout = "nhd"


def add_revision(cache: Path, repo: str, commit: str, weights: bytes, *, ref: str | None = "main") -> Path:
    """One snapshot of ``repo`` as huggingface_hub leaves it: files are symlinks to content-named blobs."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, data in (("config.json", b'{"model_type": "gpt2"}'), ("model.safetensors", weights)):
        blob = root / "blobs" / f"{commit[:8]}-{name}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def fingerprint(model="org/name", **kwargs):
    return server_fingerprint(model, LAYOUT, Pool(), **kwargs)


def test_hub_id_is_resolved_to_its_cached_snapshot(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    digest, description = fingerprint()
    assert description["model"]["snapshot"] == REV1
    assert [f[0] for f in description["model"]["files"]] == ["config.json", "model.safetensors"]
    assert description["model"]["files"][1][1] == len(b"weights one")  # the blob's size, not the symlink's
    assert digest == fingerprint()[0]


def test_new_revision_under_the_same_hub_id_is_another_identity(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    before, _ = fingerprint()
    add_revision(hub, "org/name", REV2, b"weights two!")  # refs/main now names REV2
    after, description = fingerprint()
    assert after != before
    assert description["model"]["snapshot"] == REV2
    # Pinning the old revision names the old identity again.
    assert fingerprint(revision=REV1)[0] == before


def test_branch_revision_is_followed_through_refs(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    add_revision(hub, "org/name", REV2, b"weights two!", ref="v2")
    assert fingerprint(revision="v2")[1]["model"]["snapshot"] == REV2
    assert fingerprint()[1]["model"]["snapshot"] == REV1


def test_download_dir_is_searched_first(hub, tmp_path):
    other = tmp_path / "downloads"
    add_revision(hub, "org/name", REV1, b"weights one")
    add_revision(other, "org/name", REV2, b"weights two!")
    assert fingerprint(download_dir=str(other))[1]["model"]["snapshot"] == REV2


def test_hub_id_not_in_the_cache_falls_back_to_id_and_revision(hub):
    digest, description = fingerprint("org/absent", revision="v1")
    assert description["model"]["snapshot"] is None and description["model"]["files"] == []
    assert "not in the local Hugging Face cache" in description["model"]["note"]
    assert digest != fingerprint("org/absent", revision="v2")[0]
    assert digest != fingerprint("org/other", revision="v1")[0]


@pytest.mark.parametrize(
    "settings",
    [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, {"quantization": "awq", "kv_cache_dtype": "fp8_e5m2"}],
)
def test_settings_that_change_kv_bytes_are_part_of_the_identity(hub, settings):
    add_revision(hub, "org/name", REV1, b"weights one")
    plain, _ = fingerprint()
    assert fingerprint(settings=settings)[0] != plain
    assert fingerprint(settings=settings)[0] == fingerprint(settings=dict(settings))[0]


def test_unset_settings_do_not_change_the_identity(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    assert fingerprint(settings={"quantization": None, "kv_cache_dtype": None})[0] == fingerprint()[0]


@pytest.mark.parametrize(
    "ranks",
    [{"tp_rank": 1, "tp_size": 2}, {"pp_rank": 1, "pp_size": 2}, {"dp_rank": 3}, {"tp_size": 2}],
)
def test_every_rank_has_its_own_identity(hub, ranks):
    add_revision(hub, "org/name", REV1, b"weights one")
    assert fingerprint(ranks=ranks)[0] != fingerprint()[0]


def test_default_ranks_equal_explicit_single_rank(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    single = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0}
    assert fingerprint(ranks=single)[0] == fingerprint()[0]


def test_bad_rank_is_refused_naming_it(hub):
    with pytest.raises(ValueError, match="ranks\\['tp_rank'\\]"):
        fingerprint(ranks={"tp_rank": "zero"})
    with pytest.raises(ValueError, match="ranks\\['tp_rank'\\]=2 .* tp_size=2"):
        fingerprint(ranks={"tp_rank": 2, "tp_size": 2})


def test_local_directory_weights_replaced_in_place(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"a" * 10)
    (model / "README.md").write_text("not part of the identity")
    before, description = fingerprint(str(model))
    assert description["model"]["path"] == str(model)
    assert [f[0] for f in description["model"]["files"]] == ["config.json", "model.safetensors"]
    (model / "README.md").write_text("edited")
    assert fingerprint(str(model))[0] == before
    (model / "model.safetensors").write_bytes(b"b" * 11)
    assert fingerprint(str(model))[0] != before


def test_single_gguf_file(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"g" * 5)
    before, description = fingerprint(str(gguf))
    assert description["model"]["files"][0][:2] == ["model.gguf", 5]
    gguf.write_bytes(b"g" * 6)
    assert fingerprint(str(gguf))[0] != before


def test_layout_and_pool_dtype_are_part_of_the_identity(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    base, _ = fingerprint()
    other_page = types.SimpleNamespace(page_size=8, buffer_page_bytes=[2048, 2048])
    assert server_fingerprint("org/name", other_page, Pool())[0] != base
    fp8 = Pool()
    fp8.dtype = "torch.float8_e4m3fn"
    assert server_fingerprint("org/name", LAYOUT, fp8)[0] != base


def test_snapshot_with_only_the_weight_format_sglang_fetched(hub):
    """SGLang downloads one weight format (``*.safetensors``); the repo's cached file list names more.

    huggingface_hub then calls the snapshot incomplete; it is still what SGLang loaded.
    """
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    add_revision(hub, "org/name", REV1, b"weights one")
    listing = {name: tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40)
               for name in ("config.json", "model.safetensors", "pytorch_model.bin")}
    tree_cache.write_tree_cache(str(hub / "models--org--name"), REV1, listing)
    assert fingerprint()[1]["model"]["snapshot"] == REV1


# -- what a server's arguments add to the identity (ranks.setup_of) ---------------------------


def started_with(model: Path, **server_args):
    """The identity a linker of a server started with these arguments computes (as the scheduler's does)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.server_args import ServerArgs

    from sglang_kvbm.config import KvbmConfig
    from sglang_kvbm.integration.sglang.ranks import setup_of

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4)
    identity = setup_of(ServerArgs(model_path=str(model), **server_args), params,
                        {"config": KvbmConfig(cpu_cache_blocks=8)}).identity
    return server_fingerprint(identity.model_path, LAYOUT, Pool(), revision=identity.revision,
                              settings=identity.settings, ranks=identity.ranks, download_dir=identity.download_dir)


@pytest.fixture
def local_model(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    (model / "model.safetensors").write_bytes(b"w" * 10)
    return model


def test_default_arguments_keep_the_identity_earlier_releases_computed(local_model):
    """A server started as before (load format auto, no overrides) finds the disk tier it left."""
    ranks = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "dp_rank": 0}
    before = fingerprint(str(local_model), settings={"quantization": None, "kv_cache_dtype": "auto"}, ranks=ranks)[0]
    assert started_with(local_model)[0] == before
    assert started_with(local_model, json_model_override_args="{}")[0] == before


def test_dummy_weights_never_share_disk_blocks(local_model):
    """Random weights under the real files' name: never the real weights' blocks, nor an earlier start's."""
    real, _ = started_with(local_model)
    first, description = started_with(local_model, load_format="dummy")
    second, _ = started_with(local_model, load_format="dummy")
    assert first != real and second != real
    assert first != second  # each start draws its weights again
    assert description["settings"]["load_format"] == "dummy"


def test_load_format_reading_other_files_is_another_identity(local_model):
    assert started_with(local_model, load_format="pt")[0] != started_with(local_model)[0]
    assert started_with(local_model, load_format="pt")[0] == started_with(local_model, load_format="pt")[0]


def test_model_override_args_are_part_of_the_identity(local_model):
    """``--json-model-override-args`` (rope scaling and the like) changes the K/V bytes; key order does not."""
    plain, _ = started_with(local_model)
    rope = started_with(local_model, json_model_override_args='{"rope_scaling": {"type": "linear", "factor": 2.0}}')
    same = started_with(local_model, json_model_override_args='{"rope_scaling": {"factor": 2.0, "type": "linear"}}')
    assert rope[0] != plain
    assert rope[0] == same[0]
    assert "rope_scaling" in rope[1]["settings"]["json_model_override_args"]
