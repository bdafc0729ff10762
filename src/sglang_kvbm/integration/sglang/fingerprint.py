"""The identity under which disk blocks may be reused: same model, same KV bytes, same rank.

A disk block outlives the server that wrote it. After a restart it is read back
only when everything its bytes depend on is unchanged: the model's weights, every
setting that changes what the KV pool holds (quantization, KV-cache dtype, page
size and shape), and the rank whose shard of heads or layers it holds. A block
of another identity lives in another directory and is never read.

The model is identified by what SGLang actually loaded:

* a local directory (or a single GGUF file) by its absolute path and the name,
  size and mtime of its config and weight files, so weights replaced in place
  are another model;
* a Hugging Face hub id by the snapshot SGLang loaded from the local hub cache
  (``--download-dir`` first, then ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
  ``~/.cache/huggingface/hub``; ``refs/<revision or main>`` names the commit):
  the commit and the snapshot's files, stat'ed through their symlinks into
  ``blobs/``. The cache is read offline only, never the network: the cache is
  built after SGLang has downloaded the weights it serves, so the snapshot on
  disk is the one loaded. A new revision under the same id is a new identity.
* a hub id absent from that cache (another loader, e.g. ModelScope) by the id
  and revision only: weights changed under the same id and revision are then
  not detected, and the description says so.

Weights that are not those files get no lasting identity (:func:`weight_settings`):
``--load-format dummy`` (random weights under the real files' name) and the
formats that fetch weights from elsewhere draw a new identity at every start, so
their blocks are never read by a server with the real weights, nor after a
restart. Weights replaced in memory while serving (``update_weights_from_*``)
move the running server to a new identity too (:func:`rekeyed`).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

from sglang_kvbm.backends.local.disk.format import FORMAT_VERSION
from sglang_kvbm.kv_layout import PagedKvLayout

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Config files that change how weights (and, with their KV scales, the KV) are read.
_CONFIG_NAMES = ("config.json", "quant_config.json", "quantize_config.json", "hf_quant_config.json")
_DEFAULT_RANKS = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0}
# Load formats whose weights are the model path's own files (the identity above names them).
_FILE_FORMATS = frozenset((
    "auto", "pt", "safetensors", "instanttensor", "npcache", "sharded_state", "presharded", "gguf",
    "expert_pack", "bitsandbytes", "mistral", "layered", "flash_rl", "fastsafetensors",
))
_NOTE = "note"  # readable only: left out of the digest, so rewording it never orphans a disk tier


def server_fingerprint(
    model_path: str,
    layout: PagedKvLayout,
    kvcache: Any,
    *,
    revision: Optional[str] = None,
    settings: Optional[Mapping[str, Any]] = None,
    ranks: Optional[Mapping[str, int]] = None,
    download_dir: Optional[str] = None,
) -> tuple[bytes, dict]:
    """16 bytes naming what a block's bytes depend on, and the readable description behind them.

    ``settings`` carries every server setting that changes KV bytes, e.g.
    ``{"quantization": "fp8", "kv_cache_dtype": "auto"}`` (a None value counts
    as unset); ``ranks`` this worker's place, e.g. ``{"tp_rank": 0, "tp_size":
    2, "pp_rank": 0, "pp_size": 1, "dp_rank": 0}`` (missing ones default to a
    single rank); ``download_dir`` is SGLang's ``--download-dir``.
    """
    description = {
        "format": FORMAT_VERSION,
        "model": _model(model_path, revision, download_dir),
        "settings": {str(k): str(v) for k, v in sorted((settings or {}).items()) if v is not None},
        "ranks": _ranks(ranks or {}),
        "pool": type(kvcache).__name__,
        "dtype": str(getattr(kvcache, "dtype", "")),
        "layout": getattr(kvcache, "kv_cache_layout", "nhd"),
        "page_size": layout.page_size,
        "buffer_page_bytes": list(layout.buffer_page_bytes),
    }
    return _digest(description), description


def _digest(description: dict) -> bytes:
    hashed = dict(description, model={k: v for k, v in description["model"].items() if k != _NOTE})
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).digest()[:16]


def _model(model_path: str, revision: Optional[str], download_dir: Optional[str]) -> dict:
    """What was loaded. ``--revision`` counts only where nothing more precise is known: SGLang ignores it
    for a local path, and a resolved snapshot's commit says more than the branch that led to it."""
    path = Path(model_path) if model_path else None
    if path is not None and path.is_dir():
        return {"path": os.path.abspath(model_path), "snapshot": None, "files": _files(path), _NOTE: "local directory"}
    if path is not None and path.is_file():
        return {"path": os.path.abspath(model_path), "snapshot": None, "files": [_stat(path)], _NOTE: "local file"}
    snapshot = _hub_snapshot(model_path, revision, download_dir)
    if snapshot is None:
        return {"id": model_path, "revision": revision, "snapshot": None, "files": [],
                _NOTE: f"{model_path!r} is not in the local Hugging Face cache ({', '.join(_hub_caches(download_dir))}): "
                "identified by id and revision only, so new weights under the same revision are not detected"}
    return {"id": model_path, "snapshot": snapshot.name, "files": _files(snapshot),
            _NOTE: f"revision {revision or 'main'}: snapshot {snapshot} of the local Hugging Face cache"}


def _files(directory: Path) -> list[list]:
    """``[name, size, mtime_ns]`` of the config and weight files, symlinks followed (hub snapshots link to blobs)."""
    return [
        _stat(path)
        for path in sorted(directory.iterdir())
        if path.name in _CONFIG_NAMES or path.suffix in _WEIGHT_SUFFIXES
    ]


def _stat(path: Path) -> list:
    try:
        stat = path.stat()
    except OSError:  # a dangling link into blobs/: a half-removed download, still part of the identity
        return [path.name, None, None]
    return [path.name, stat.st_size, stat.st_mtime_ns]


def _hub_caches(download_dir: Optional[str]) -> list[str]:
    """Where SGLang looks for a hub id's snapshot, in its order: ``--download-dir``, then the default cache.

    The default is read from the environment now, with huggingface_hub's own
    precedence, rather than from ``huggingface_hub.constants``, which froze it
    when first imported.
    """
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    default = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    caches = [download_dir] if download_dir else []
    return caches + [os.path.expandvars(os.path.expanduser(default))]


def _hub_snapshot(repo_id: str, revision: Optional[str], download_dir: Optional[str]) -> Optional[Path]:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (default ``main``), or None; never online."""
    if not repo_id:
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:
        return None
    for cache in _hub_caches(download_dir):
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
        except IncompleteSnapshotError as exc:
            # SGLang fetches only the weight format it loads (e.g. *.safetensors, not *.bin):
            # complete for SGLang, though the repository lists more files.
            return Path(exc.snapshot_path)
        except (OSError, ValueError):  # not cached here (LocalEntryNotFoundError), or not a hub id at all
            continue
    return None


def _ranks(ranks: Mapping[str, int]) -> dict[str, int]:
    merged = dict(_DEFAULT_RANKS)
    for key, value in ranks.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"server_fingerprint ranks[{key!r}]={value!r} must be a whole number >= 0: pass the worker's rank")
        merged[str(key)] = value
    for name in ("tp", "pp"):
        rank, size = merged[f"{name}_rank"], merged[f"{name}_size"]
        if size < 1 or rank >= size:
            raise ValueError(
                f"server_fingerprint ranks[{name + '_rank'!r}]={rank} does not fit {name}_size={size}: "
                f"pass a rank from 0 to {name}_size - 1 and the size the server runs with"
            )
    return merged


def weight_settings(load_format: Optional[str], json_model_override_args: Optional[str]) -> dict[str, Optional[str]]:
    """The settings that decide which weights and which model config produce the KV, besides the files.

    ``--load-format``: ``auto`` (the default) adds nothing, so identities of
    servers started before this setting was recorded stay the same; another
    format that reads the files names itself (``pt`` may read other files than
    ``safetensors``). Any other format's weights are not the files at all:
    ``dummy`` draws random weights (SGLang seeds them per parameter, but what the
    draw yields depends on the device's generator, torch's and SGLang's versions,
    none of which the identity names), ``remote``/``remote_instance``/... fetch
    them from elsewhere. Such a server gets a new identity at every start: its
    disk blocks are never read by another server, nor by itself after a restart
    (the directory is reclaimed by the next start; the disk tier still serves
    while the server runs).

    ``--json-model-override-args`` (rope scaling, head counts, ...) changes what
    the model computes from the same files: its JSON, keys sorted; ``{}`` adds
    nothing.
    """
    fmt = str(load_format or "auto")
    overrides = json_model_override_args or None
    if overrides is not None:
        try:
            parsed = json.loads(overrides)
            overrides = json.dumps(parsed, sort_keys=True) if parsed else None
        except ValueError:  # SGLang refuses it before any cache is built; name it as given
            pass
    return {
        "load_format": None if fmt == "auto" else fmt,
        "weights_drawn_at_start": None if fmt in _FILE_FORMATS else uuid.uuid4().hex,
        "json_model_override_args": overrides,
    }


def rekeyed(fingerprint: bytes, reason: str) -> bytes:
    """A new identity for a running server whose weights were replaced in memory (``reason`` says how).

    Derived from the old one, the reason and a random draw: no server started
    from files, nor this one after a restart, ever computes it, so what the
    disk tier writes from now on is never read by another server.
    """
    draw = f"weights updated in memory: {reason}: {uuid.uuid4().hex}".encode()
    return hashlib.sha256(fingerprint + draw).digest()[:16]
