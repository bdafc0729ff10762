"""What a server's arguments add to the identity, row by row of the argument table (``server_args_table``).

A property of the construction, checked for every row rather than for a few
chosen flags: changing any argument the table says changes KV bytes changes the
identity; changing the content of any file such an argument names changes it;
moving or touching those files, or changing an argument of another class, does not.
Each of the wrong-KV cases a review found (FP8 scale file, Mamba SSM dtype, LoRA
adapter retrained in place, draft model) is a row here and has a test of its own.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.server_args import ServerArgs

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.integration.sglang.fingerprint import SERVER_DRAW_ENV, model_identity, server_fingerprint
from sglang_kvbm.integration.sglang.ranks import setup_of
from sglang_kvbm.integration.sglang.server_args_table import KV_BYTES, KV_FILES, NAMESPACE, NEITHER

LAYOUT = types.SimpleNamespace(page_size=4, buffer_page_bytes=[1024, 1024])
Pool = types.SimpleNamespace(dtype="torch.bfloat16", kv_cache_layout="nhd")
# Read by the model's own identity: its content (a revision counts for a hub id only, as SGLang reads it).
MODEL_ROWS = {"model_path", "revision"}


@pytest.fixture(autouse=True)
def digests(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_KVBM_DIGEST_CACHE", str(tmp_path / "digests.json"))
    monkeypatch.delenv(SERVER_DRAW_ENV, raising=False)  # a draw made here ends with the test


@pytest.fixture
def model(tmp_path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "gpt2"}')
    (directory / "model.safetensors").write_bytes(b"w" * 10)
    return directory


def identity(args: ServerArgs) -> bytes:
    """The disk identity a linker of a server started with ``args`` computes, as the scheduler's does."""
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4)
    setup = setup_of(args, params, {"config": KvbmConfig(cpu_cache_blocks=8)})
    model = model_identity(setup.identity.model_path, setup.identity.revision, setup.identity.download_dir)
    return server_fingerprint(model, LAYOUT, Pool, settings=setup.identity.settings, ranks=setup.identity.ranks)[0]


def other(value):
    """A value unlike ``value`` of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, (list, tuple)):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return "other"


INSTALLED = frozenset(ServerArgs.__struct_fields__)  # the table is the union of the supported releases' fields


@pytest.mark.parametrize("field", sorted((KV_BYTES - MODEL_ROWS) & INSTALLED))
def test_every_argument_that_changes_kv_bytes_changes_the_identity(model, field):
    args = ServerArgs(model_path=str(model))
    before = identity(args)
    setattr(args, field, other(getattr(args, field)))
    assert identity(args) != before, f"--{field.replace('_', '-')} changes KV bytes but not the identity"


@pytest.mark.parametrize("field", sorted((NAMESPACE | NEITHER) & INSTALLED))
def test_arguments_that_do_not_change_kv_bytes_leave_the_identity(model, field):
    args = ServerArgs(model_path=str(model))
    before = identity(args)
    try:
        setattr(args, field, other(getattr(args, field)))
    except (TypeError, AttributeError):  # a read-only field: nothing to change
        return
    assert identity(args) == before


@pytest.mark.parametrize("field", sorted((KV_FILES - MODEL_ROWS) & INSTALLED))
def test_every_file_an_argument_names_counts_by_content(model, tmp_path, field):
    """Rewritten in place (same size, mtime restored): another identity. Moved and touched: the same."""
    scales = tmp_path / "files" / "scales.json"
    scales.parent.mkdir()
    scales.write_text('{"k_scale": 1.0}')
    args = ServerArgs(model_path=str(model))
    setattr(args, field, str(scales))
    first = identity(args)
    mtime = scales.stat().st_mtime_ns
    scales.write_text('{"k_scale": 2.0}')
    os.utime(scales, ns=(mtime, mtime))
    second = identity(args)
    assert second != first, f"--{field.replace('_', '-')} names a file whose content is not in the identity"
    moved = scales.rename(tmp_path / "elsewhere.json")
    os.utime(moved, ns=(1, 1))
    setattr(args, field, str(moved))
    assert identity(args) == second


def test_fp8_scale_file_is_in_the_identity(model, tmp_path):
    """--quantization-param-path (the k_scale/v_scale SGLang divides K and V by): another file, other KV."""
    one, two = tmp_path / "a.json", tmp_path / "b.json"
    one.write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    two.write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.25}}}}')
    args = ServerArgs(model_path=str(model), kv_cache_dtype="fp8_e4m3")
    plain = identity(args)
    args.quantization_param_path = str(one)
    with_one = identity(args)
    args.quantization_param_path = str(two)
    assert len({plain, with_one, identity(args)}) == 3


def test_mamba_ssm_dtype_is_in_the_identity(model):
    """bf16 and fp16 states have the same size: only the identity keeps a restart from reading one as the other."""
    assert "mamba_ssm_dtype" in KV_BYTES
    bf16 = identity(ServerArgs(model_path=str(model), mamba_ssm_dtype="bfloat16"))
    assert bf16 != identity(ServerArgs(model_path=str(model), mamba_ssm_dtype="float16"))


def adapter(directory: Path, weights: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


@pytest.mark.parametrize("form", ["name=path", "path", "dict"])
def test_a_lora_adapter_retrained_in_place_is_another_identity(model, tmp_path, form):
    """SGLang names an adapter by uuid5(name, path): its block ids stay; the server identity must not."""
    path = adapter(tmp_path / "adapters" / "sql", b"a" * 64)
    value = {"name=path": f"sql={path}", "path": str(path),
             "dict": {"lora_name": "sql", "lora_path": str(path)}}[form]
    args = ServerArgs(model_path=str(model), lora_paths=[value])
    before = identity(args)
    adapter(path, b"b" * 64)  # retrained: same files, same sizes, new bytes
    assert identity(args) != before


def test_the_same_adapter_on_two_hosts_is_the_same_identity(model, tmp_path):
    a = adapter(tmp_path / "host-a" / "sql", b"a" * 64)
    b = adapter(tmp_path / "host-b" / "sql", b"a" * 64)
    os.utime(b / "adapter_model.safetensors", ns=(7, 7))
    assert identity(ServerArgs(model_path=str(model), lora_paths=[f"sql={a}"])) == \
        identity(ServerArgs(model_path=str(model), lora_paths=[f"sql={b}"]))


def test_draft_model_is_in_the_identity_by_content(model, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"model_type": "llama"}')
    (draft / "model.safetensors").write_bytes(b"d" * 16)
    args = ServerArgs(model_path=str(model), speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft))
    before = identity(args)
    (draft / "model.safetensors").write_bytes(b"e" * 16)
    assert identity(args) != before


def test_dummy_weights_share_across_starts_and_never_with_real_weights(model):
    """SGLang's dummy weights are seeded per parameter: the same on every rank and start of one SGLang and torch."""
    real = identity(ServerArgs(model_path=str(model)))
    first = identity(ServerArgs(model_path=str(model), load_format="dummy"))
    assert first == identity(ServerArgs(model_path=str(model), load_format="dummy"))
    assert first != real
    assert first != identity(ServerArgs(model_path=str(model), load_format="dummy", device="cuda"))


def test_weights_from_elsewhere_get_one_draw_per_server_start(model, monkeypatch):
    """No name for remote weights: one draw per start, shared by the server's ranks (inherited from the launcher)."""
    first = identity(ServerArgs(model_path=str(model), load_format="remote"))
    assert first == identity(ServerArgs(model_path=str(model), load_format="remote"))  # another rank of it
    monkeypatch.delenv(SERVER_DRAW_ENV)  # the next start
    assert identity(ServerArgs(model_path=str(model), load_format="remote")) != first


def test_model_override_args_key_order_does_not_matter(model):
    plain = identity(ServerArgs(model_path=str(model)))
    rope = identity(ServerArgs(model_path=str(model),
                               json_model_override_args='{"rope_scaling": {"type": "linear", "factor": 2.0}}'))
    same = identity(ServerArgs(model_path=str(model),
                               json_model_override_args='{"rope_scaling": {"factor": 2.0, "type": "linear"}}'))
    assert rope != plain and rope == same
    assert identity(ServerArgs(model_path=str(model), json_model_override_args="{}")) == plain


def test_a_field_this_release_lacks_is_absent_from_the_identity_not_defaulted(model):
    """The table holds every supported release's fields; a server reads only those its ServerArgs has."""
    from sglang_kvbm.integration.sglang.server_args_table import KV_BYTES as TABLE_KV_BYTES
    from sglang_kvbm.integration.sglang.server_args_table import KV_FILES as TABLE_KV_FILES
    from sglang_kvbm.integration.sglang.server_identity import kv_settings

    settings = kv_settings(ServerArgs(model_path=str(model)))
    assert not (TABLE_KV_BYTES - INSTALLED) & set(settings)
    plain = types.SimpleNamespace(model_path=str(model), kv_cache_dtype="fp8_e4m3")  # a custom server's own record
    assert (TABLE_KV_BYTES | TABLE_KV_FILES) & set(kv_settings(plain)) == {"kv_cache_dtype", "load_format",
                                                                           "json_model_override_args"}  # fingerprint


def test_the_sglang_release_is_in_the_identity(model, monkeypatch):
    from importlib import metadata

    from sglang_kvbm.integration.sglang import server_identity

    args = ServerArgs(model_path=str(model))
    before = identity(args)
    installed = metadata.version("sglang")
    monkeypatch.setattr(server_identity, "_release", lambda: installed + ".post1")
    assert identity(args) != before
