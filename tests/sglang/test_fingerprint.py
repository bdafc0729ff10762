"""The identity of stored blocks: the same bytes share it wherever they are, other KV never does.

Hub ids are resolved offline through a Hugging Face cache laid out in a temporary
directory, the way ``huggingface_hub`` stores downloads: ``snapshots/<commit>/``
holds symlinks into ``blobs/``, named by the SHA-256 of a large (LFS) file's
content and by git's SHA-1 of a small one; ``refs/main`` names the current commit.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import types
from pathlib import Path

import pytest

from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.integration.sglang.fingerprint import model_identity, server_fingerprint

REV1 = "1" * 40
REV2 = "2" * 40
LAYOUT = types.SimpleNamespace(page_size=4, buffer_page_bytes=[1024, 1024])
CONFIG = b'{"model_type": "gpt2"}'


class Pool:
    dtype = "torch.bfloat16"
    kv_cache_layout = "nhd"


def add_revision(cache: Path, repo: str, commit: str, weights: bytes, *, ref: str | None = "main") -> Path:
    """One snapshot of ``repo`` as huggingface_hub leaves it: files are symlinks to content-named blobs."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, data in (("config.json", CONFIG), ("model.safetensors", weights)):
        if name.endswith(".safetensors"):  # LFS: the blob is named by the SHA-256 of its content
            blob_name = hashlib.sha256(data).hexdigest()
        else:  # a small file: git's blob SHA-1
            blob_name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = root / "blobs" / blob_name
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(autouse=True)
def digests(tmp_path, monkeypatch):
    """A digest cache of the test's own (never the user's ~/.cache)."""
    monkeypatch.setenv("SGLANG_KVBM_DIGEST_CACHE", str(tmp_path / "digests.json"))
    return DigestCache(tmp_path / "digests.json")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def fingerprint(model="org/name", revision=None, download_dir=None, **kwargs):
    return server_fingerprint(model_identity(model, revision, download_dir), LAYOUT, Pool(), **kwargs)


def write_model(directory: Path, weights: bytes = b"w" * 10) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_bytes(CONFIG)
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def test_hub_snapshot_is_named_by_its_content_without_reading_large_blobs(hub, digests):
    add_revision(hub, "org/name", REV1, b"weights one")
    digest, description = fingerprint()
    content = dict(description["model"]["content"])
    assert content == {"config.json": hashlib.sha256(CONFIG).hexdigest(),
                       "model.safetensors": hashlib.sha256(b"weights one").hexdigest()}
    assert "snapshot" in description["model"]["note"] and REV1 in description["model"]["note"]
    assert digest == fingerprint()[0]


def test_a_local_copy_of_a_hub_snapshot_is_the_same_model(hub, tmp_path):
    """Two hosts, one downloaded through the hub, one copied the files elsewhere: the same identity."""
    add_revision(hub, "org/name", REV1, b"weights one")
    copy = write_model(tmp_path / "elsewhere" / "my-model", b"weights one")
    assert fingerprint(str(copy))[0] == fingerprint("org/name")[0]


def test_same_bytes_at_another_path_with_other_mtimes_are_the_same_model(tmp_path):
    a = write_model(tmp_path / "host-a" / "model")
    b = tmp_path / "host-b" / "models" / "copy"
    shutil.copytree(a, b)  # copytree keeps mtimes: set others, as a second download would
    for f in b.iterdir():
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    assert fingerprint(str(a))[0] == fingerprint(str(b))[0]
    assert fingerprint(str(a))[1]["model"]["content"] == fingerprint(str(b))[1]["model"]["content"]


def test_new_revision_under_the_same_hub_id_is_another_identity(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    before, _ = fingerprint()
    add_revision(hub, "org/name", REV2, b"weights two!")  # refs/main now names REV2
    after, description = fingerprint()
    assert after != before
    assert REV2 in description["model"]["note"]
    assert fingerprint(revision=REV1)[0] == before  # pinning the old revision names the old identity again


def test_branch_revision_is_followed_through_refs(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    add_revision(hub, "org/name", REV2, b"weights two!", ref="v2")
    assert fingerprint(revision="v2")[0] != fingerprint()[0]
    assert fingerprint(revision=REV2)[0] == fingerprint(revision="v2")[0]


def test_download_dir_is_searched_first(hub, tmp_path):
    other = tmp_path / "downloads"
    add_revision(hub, "org/name", REV1, b"weights one")
    add_revision(other, "org/name", REV2, b"weights two!")
    assert REV2 in fingerprint(download_dir=str(other))[1]["model"]["note"]


def test_hub_id_not_in_the_cache_falls_back_to_id_and_revision(hub):
    digest, description = fingerprint("org/absent", revision="v1")
    assert "content" not in description["model"]
    assert "not in the local Hugging Face cache" in description["model"]["note"]
    assert digest != fingerprint("org/absent", revision="v2")[0]
    assert digest != fingerprint("org/other", revision="v1")[0]


def test_named_identity_reads_nothing_and_names_the_weights(tmp_path, digests):
    model = write_model(tmp_path / "model")
    named = server_fingerprint(model_identity(str(model), named="m@v1", cache=digests), LAYOUT, Pool())
    assert digests.read_bytes == 0
    assert named[1]["model"]["named"] == "m@v1"
    assert named[0] != fingerprint(str(model))[0]
    assert named[0] != server_fingerprint(model_identity(str(model), named="m@v2"), LAYOUT, Pool())[0]


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
    model = write_model(tmp_path / "model")
    (model / "README.md").write_text("not part of the identity")
    before, description = fingerprint(str(model))
    assert str(model) in description["model"]["note"]  # readable, not hashed
    assert [f[0] for f in description["model"]["content"]] == ["config.json", "model.safetensors"]
    (model / "README.md").write_text("edited")
    assert fingerprint(str(model))[0] == before
    (model / "model.safetensors").write_bytes(b"b" * 10)  # same size
    assert fingerprint(str(model))[0] != before


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "merges.txt",
                                  "modeling_custom.py", "quant_config.json", "model-00002-of-00002.safetensors"])
def test_every_file_the_model_is_built_from_is_in_it(tmp_path, name):
    model = write_model(tmp_path / "model")
    before, _ = fingerprint(str(model))
    (model / name).write_bytes(b"one")
    added, _ = fingerprint(str(model))
    (model / name).write_bytes(b"two")
    assert len({before, added, fingerprint(str(model))[0]}) == 3


def test_touching_or_moving_files_is_the_same_model_and_is_not_read_again(tmp_path, digests):
    model = write_model(tmp_path / "model", b"x" * 4096)
    before = server_fingerprint(model_identity(str(model), cache=digests), LAYOUT, Pool())[0]
    first_read = digests.read_bytes
    assert first_read == len(CONFIG) + 4096
    again = DigestCache(digests.path)
    assert server_fingerprint(model_identity(str(model), cache=again), LAYOUT, Pool())[0] == before
    assert again.read_bytes == 0  # a restart reads nothing
    os.utime(model / "model.safetensors", ns=(5, 5))
    moved = model.rename(tmp_path / "moved")
    assert fingerprint(str(moved))[0] == before


def test_bytes_rewritten_under_a_restored_mtime_are_read_again(tmp_path, digests):
    """The cache key holds the ctime, which no ``touch`` can set back."""
    model = write_model(tmp_path / "model")
    before = server_fingerprint(model_identity(str(model), cache=digests), LAYOUT, Pool())[0]
    weights = model / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"v" * 10)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(str(model))[0] != before


def test_a_damaged_digest_cache_is_started_anew(tmp_path, digests):
    model = write_model(tmp_path / "model")
    before = fingerprint(str(model))[0]
    digests.path.write_text('{"1:2:3:4:5": "not a digest"')
    assert fingerprint(str(model))[0] == before


def test_single_gguf_file(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"g" * 5)
    before, description = fingerprint(str(gguf))
    assert description["model"]["content"] == [["", hashlib.sha256(b"g" * 5).hexdigest()]]
    gguf.write_bytes(b"h" * 5)
    assert fingerprint(str(gguf))[0] != before
    assert fingerprint(str(gguf.rename(tmp_path / "renamed.gguf")))[0] != before


def test_layout_and_pool_dtype_are_part_of_the_identity(hub):
    add_revision(hub, "org/name", REV1, b"weights one")
    base, _ = fingerprint()
    model = model_identity("org/name")
    other_page = types.SimpleNamespace(page_size=8, buffer_page_bytes=[2048, 2048])
    assert server_fingerprint(model, other_page, Pool())[0] != base
    fp8 = Pool()
    fp8.dtype = "torch.float8_e4m3fn"
    assert server_fingerprint(model, LAYOUT, fp8)[0] != base


def test_snapshot_with_only_the_weight_format_sglang_fetched(hub):
    """SGLang downloads one weight format (``*.safetensors``); the repo's cached file list names more.

    huggingface_hub then calls the snapshot incomplete; it is still what SGLang loaded.
    """
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    add_revision(hub, "org/name", REV1, b"weights one")
    listing = {name: tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40)
               for name in ("config.json", "model.safetensors", "pytorch_model.bin")}
    tree_cache.write_tree_cache(str(hub / "models--org--name"), REV1, listing)
    assert REV1 in fingerprint()[1]["model"]["note"]
