"""The server arguments in a block's identity: every one the table says changes KV bytes, files by content.

``server_args_table`` classifies every field of SGLang's ``ServerArgs``
(``tests/sglang/test_server_args_table.py`` fails when an installed SGLang has one it
does not list). Here that table becomes the ``settings`` of the identity:

* each ``KV_BYTES`` field by its value (lists and dicts as sorted JSON);
* each ``KV_FILES`` field by the content of what it names (a file, a directory,
  a hub id in the local cache, ``name=path`` pairs, LoRA references), through
  the same digests as the model (``fingerprint.model_identity``): a scale file,
  draft model or adapter retrained in place is another identity, the same one
  copied to another host is not;
* the model itself and how its weights were loaded by ``fingerprint``.

``NAMESPACE`` fields (the served model name, the page size, ...) name blocks or
their sharing rather than their bytes, and are used where they do that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.integration.sglang.fingerprint import model_identity, weight_settings
from sglang_kvbm.integration.sglang.server_args_table import KV_BYTES, KV_FILES

# Read by fingerprint itself (the model by content; load format and overrides by weight_settings).
_BY_FINGERPRINT = frozenset(("model_path", "revision", "load_format", "json_model_override_args"))


def kv_settings(server_args: Any, cache: Optional[DigestCache] = None) -> dict:
    """``{field: value}`` for every argument that changes KV bytes (None: unset), files by their content, and the
    SGLang release that computes the bytes.

    A field this release's ``ServerArgs`` lacks is left out, not read as None: it is absent, as on the release
    (``server_args_table.ABSENT_IN``). The release itself is in: the same prompt's KV from another release's
    kernels and torch is not shown to be the same bytes (a rolling upgrade starts its lower tiers cold).
    """
    cache = cache or DigestCache()
    settings: dict = {"sglang": _release()}
    fields = getattr(type(server_args), "__struct_fields__", None)
    has = (lambda name: name in fields) if fields is not None else (lambda name: hasattr(server_args, name))
    for name in sorted(KV_BYTES - _BY_FINGERPRINT):
        if has(name):
            settings[name] = _plain(getattr(server_args, name))
    model_path = str(getattr(server_args, "model_path", "") or "")
    download_dir = getattr(server_args, "download_dir", None)
    for name in sorted(KV_FILES - _BY_FINGERPRINT):
        if not has(name):
            continue
        value = getattr(server_args, name, None)
        if name == "tokenizer_path" and str(value or "") in ("", model_path):
            continue  # the model's own tokenizer files are in the model's content
        settings[name] = files_content(value, download_dir=download_dir, cache=cache)
    settings.update(weight_settings(getattr(server_args, "load_format", None),
                                    getattr(server_args, "json_model_override_args", None),
                                    device=str(getattr(server_args, "device", None) or "")))
    return settings


def _release() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:  # a custom server without SGLang's package
        return None


def files_content(value: Any, *, download_dir: Optional[str] = None, cache: Optional[DigestCache] = None
                  ) -> Optional[str]:
    """A SHA-256 over the content of everything ``value`` names (None when it names nothing)."""
    named = list(_paths(value))
    if not named:
        return None
    cache = cache or DigestCache()
    content = [[label, _without_note(model_identity(path, download_dir=download_dir, cache=cache))]
               for label, path in named]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _without_note(identity: dict) -> dict:
    return {k: v for k, v in identity.items() if k != "note"}


def _paths(value: Any, label: str = ""):
    """``(label, path or hub id)`` pairs in an argument's value: a string, ``name=path``, a list, a dict or a
    reference object with a ``lora_path`` (SGLang's ``LoRARef``)."""
    if value is None or value == "":
        return
    if isinstance(value, str):
        name, sep, path = value.partition("=")
        if sep and name and path and "/" not in name:
            yield (name, path)  # --lora-paths name=path
        else:
            yield (label, value)
    elif isinstance(value, dict):
        if "lora_path" in value:  # --lora-paths '{"lora_name": ..., "lora_path": ...}'
            yield (str(value.get("lora_name") or label), str(value["lora_path"]))
        else:
            for key, item in sorted(value.items(), key=lambda kv: str(kv[0])):
                yield from _paths(item, str(key))
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _paths(item, label)
    elif hasattr(value, "lora_path"):
        yield (str(getattr(value, "lora_name", "") or label), str(value.lora_path))
    else:
        yield (label, str(value))


def _plain(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return json.dumps(sorted(value) if isinstance(value, (set, frozenset)) else value, sort_keys=True,
                          default=str)
    return str(value)
