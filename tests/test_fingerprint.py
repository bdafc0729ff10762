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
