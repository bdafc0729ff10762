"""The identity under which stored blocks may be reused: the same KV bytes, wherever they were computed.

A block outlives the server that wrote it (disk), and other hosts read it
(the shared tier): it is read back only by a server whose KV bytes for the same
tokens are the same. That is decided by content, never by location:

* **the model** by the SHA-256 of every file that decides what it computes
  (weights, every ``*.json`` config, tokenizer files, custom modeling code):
  two hosts holding the same bytes at other paths, downloaded at other times,
  get the same identity; any changed byte gives another. A Hugging Face hub id
  is resolved offline to the snapshot SGLang loaded (``--download-dir`` first,
  then ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``), whose
  large files are already named by their SHA-256 (``blobs/``), so a local copy of
  a snapshot and the snapshot itself are the same model. Local files are read
  once and their digests cached (``core.content_digest``). A hub id absent from
  that cache is identified by id and revision only, and the description says so.
  ``SGLANG_KVBM_MODEL_IDENTITY`` names the model instead, for operators who
  version their weights (nothing is read; they vouch for it);
* **every server argument that changes KV bytes**, by the table in
  ``server_args_table`` (files an argument names, by content: ``server_identity``);
* **each pool's shape and dtypes** and the rank's shard.

Weights that are not files get no lasting identity (:func:`weight_settings`).
Weights replaced in memory while serving move the server to a new identity
(:func:`rekeyed`).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.tiers.format import FORMAT_VERSION
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Besides weights: configs (model, quantization, generation), tokenizer files and remote code.
_KV_SUFFIXES = _WEIGHT_SUFFIXES + (".json", ".py", ".model", ".tiktoken")
_KV_NAMES = ("vocab.txt", "merges.txt")
_DEFAULT_RANKS = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0}
# Load formats whose weights are the model path's own files (the identity above names them).
_FILE_FORMATS = frozenset((
    "auto", "pt", "safetensors", "instanttensor", "npcache", "sharded_state", "presharded", "gguf",
    "expert_pack", "bitsandbytes", "mistral", "layered", "flash_rl", "fastsafetensors",
))
_NOTE = "note"  # readable only: left out of the digest, so rewording it never orphans a disk tier
NAMED_ENV = "SGLANG_KVBM_MODEL_IDENTITY"
SERVER_DRAW_ENV = "_SGLANG_KVBM_SERVER_DRAW"  # internal: not a setting (those are checked by name)


def server_fingerprint(
    model: Mapping[str, Any],
    layout: PagedKvLayout,
    kvcache: Any,
    *,
    settings: Optional[Mapping[str, Any]] = None,
    ranks: Optional[Mapping[str, int]] = None,
) -> tuple[bytes, dict]:
    """16 bytes naming what a block's bytes depend on, and the readable description behind them.

    ``model`` is :func:`model_identity`'s; ``settings`` every server setting that
    changes KV bytes, e.g. ``{"quantization": "fp8", "kv_cache_dtype": "auto"}`` (a
    None value counts as unset); ``ranks`` this worker's place, e.g. ``{"tp_rank":
    0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "dp_rank": 0}`` (missing ones
    default to a single rank).
    """
    description = {
        "format": FORMAT_VERSION,
        "model": dict(model),
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


def model_identity(model_path: str, revision: Optional[str] = None, download_dir: Optional[str] = None, *,
                   cache: Optional[DigestCache] = None, named: Optional[str] = None) -> dict:
    """What was loaded, by content. ``--revision`` counts only where nothing more precise is known: SGLang ignores
    it for a local path, and a snapshot's content says more than the branch that led to it."""
    if named:  # SGLANG_KVBM_MODEL_IDENTITY (KvbmConfig.model_identity, validated there)
        return {"named": named, _NOTE: f"named by {NAMED_ENV}: nothing read, the operator vouches for the weights"}
    cache = cache or DigestCache()
    path = Path(model_path) if model_path else None
    if path is not None and path.is_dir():
        return {"content": _content(_kv_files(path), cache), _NOTE: f"local directory {os.path.abspath(path)}"}
    if path is not None and path.is_file():
        return {"content": _content([path], cache, names=False), _NOTE: f"local file {os.path.abspath(path)}"}
    snapshot = _hub_snapshot(model_path, revision, download_dir)
    if snapshot is None:
        return {"id": model_path, "revision": revision,
                _NOTE: f"{model_path!r} is not in the local Hugging Face cache ({', '.join(_hub_caches(download_dir))}): "
                "identified by id and revision only, so new weights under the same revision are not detected"}
    return {"content": _content(_kv_files(snapshot), cache),
            _NOTE: f"{model_path} revision {revision or 'main'}: snapshot {snapshot} of the local Hugging Face cache"}


def _kv_files(directory: Path) -> list[Path]:
    """The top-level files SGLang reads to build the model (weights, configs, tokenizer, code), links followed."""
    return [path for path in sorted(directory.iterdir())
            if (path.suffix in _KV_SUFFIXES or path.name in _KV_NAMES) and not path.name.startswith(".")
            and (path.is_file() or (path.is_symlink() and not path.exists()))]


def _content(files: list[Path], cache: DigestCache, *, names: bool = True) -> list[list]:
    """``[name, sha256]`` per file (a dangling link into ``blobs/``, a half-removed download: ``[name, None]``)."""
    present = [f for f in files if f.exists()]
    digests = dict(zip(present, cache.digests(present)))
    return [[f.name if names else "", digests.get(f)] for f in files]


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


def weight_settings(load_format: Optional[str], json_model_override_args: Optional[str], *,
                    device: str = "") -> dict[str, Optional[str]]:
    """The settings that decide which weights and which model config produce the KV, besides the files.

    ``--load-format``: ``auto`` adds nothing; another format that reads the
    files names itself (``pt`` may read other files than ``safetensors``).
    ``dummy`` draws random weights from a fixed seed per parameter: the same
    draw on every rank and at every start of the same SGLang and torch, which
    :func:`dummy_weights` names. Any other format fetches its weights from
    elsewhere (``remote``, ``remote_instance``, ...): nothing names them, so a
    server gets one draw per start, the same on all its ranks (the launcher's
    draw, inherited through ``_SGLANG_KVBM_SERVER_DRAW``, drawn by ``flags.translate``): its blocks are never
    read by another server, nor after a restart.

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
    drawn = None
    if fmt == "dummy":
        drawn = dummy_weights(device)
    elif fmt not in _FILE_FORMATS:
        drawn = server_draw()
    return {"load_format": None if fmt == "auto" else fmt, "weights_drawn_at_start": drawn,
            "json_model_override_args": overrides}


def dummy_weights(device: str) -> str:
    """What SGLang's dummy weights depend on besides the model's config: its seeded initializer, and torch's
    generator on the device the parameters are drawn on."""
    import torch

    try:
        from importlib.metadata import version

        sglang = version("sglang")
    except Exception:  # a source checkout without metadata: name it by its package only
        sglang = "unknown"
    return f"dummy weights: sglang {sglang}, torch {torch.__version__}, device {device or 'default'}"


def server_draw() -> str:
    """One random draw per server start, the same in all its processes (they inherit the launcher's environment)."""
    return os.environ.setdefault(SERVER_DRAW_ENV, uuid.uuid4().hex)

