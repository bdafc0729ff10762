"""SGLang's ``--kv-events-config``, checked the way this library depends on it, before SGLang starts.

SGLang parses the flag with pydantic (``KVEventsConfig.from_cli`` in
``sglang/srt/disaggregation/kv_events.py``) and reports a bad value as a
validation dump from a scheduler process, or not at all: a negative
``buffer_steps`` or ``hwm`` passes the parser and kills the publisher thread. This
check accepts what SGLang accepts (its lax coercions included: ``"bind": "yes"``,
``"hwm": "1000"``, ``"hwm": 1e3``; unknown keys are ignored with a warning, as
SGLang ignores them) and refuses, naming the field and the fix:

* what SGLang refuses (a non-object, a null ``endpoint``, ``"format": "Dynamo"``);
* what SGLang takes but cannot run: a publisher other than ``zmq`` (``null``
  means off; names are case-sensitive in SGLang's registry), an endpoint that is
  not ``tcp://host:port``, ``ipc://path`` or ``inproc://name``, a replay endpoint
  that would bind the publisher's own port, ``buffer_steps`` below 0, ``hwm``
  outside 0 to 2**31 - 1 (ZMQ's int);
* a ``page_size`` below 1: events carry one page per block, and Dynamo's router
  must run with ``--block-size`` equal to it.

``max_queue_size`` below 1 means unbounded (Python's ``Queue``), ``hwm`` 0
means no ZMQ limit, ``buffer_steps`` 0 means no replay history: SGLang runs
with each, so they are accepted.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from typing import Any, Optional

from sglang_kvbm.base.values import ConfigError

logger = logging.getLogger(__name__)

FLAG = "--kv-events-config"
EXAMPLE = '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\''
# SGLang 0.5.23's KVEventsConfig defaults, field by field (tests/ops/test_events_config.py compares them).
DEFAULTS: dict[str, Any] = {
    "publisher": "null",
    "endpoint": "tcp://*:5557",
    "bind": None,
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
    "format": "default",
}
FORMATS = ("default", "dynamo")
# field -> (lowest, highest, what to set): what SGLang's publisher runs with.
_INTS = {
    "buffer_steps": (0, (1 << 63) - 1, "a whole number, 0 or more (0 keeps no replay history)"),
    "hwm": (0, (1 << 31) - 1, "a whole number from 0 to 2147483647 (0: no ZMQ limit)"),
    "max_queue_size": (None, None, "a whole number (0 or less: unbounded)"),
}
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})  # pydantic's lax booleans
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT = re.compile(r"[+-]?[0-9]+(_[0-9]+)*")


def check_kv_events_config(raw: Optional[str], page_size: int) -> Optional[dict]:
    """The events configuration with SGLang's defaults filled in, plus ``block_size`` (the page size
    Dynamo's router must use); None when events are off (no flag, or ``"publisher": "null"``)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ConfigError(f"--page-size {page_size!r} cannot carry KV events: set --page-size to 1 or more, e.g. 16")
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{FLAG} is not valid JSON ({exc}): pass an object, e.g. {FLAG} {EXAMPLE}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{FLAG} must be a JSON object, not {type(data).__name__}: pass one, e.g. {FLAG} {EXAMPLE}")
    for key in data:
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), list(DEFAULTS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            logger.warning("kvbm: %s key %r is not one SGLang reads; SGLang ignores it%s", FLAG, key, hint)
    config = dict(DEFAULTS)
    config.update({k: v for k, v in data.items() if k in DEFAULTS})
    config["publisher"] = _publisher(config["publisher"])
    config["endpoint"] = _endpoint("endpoint", config["endpoint"])
    config["bind"] = _bind(config["bind"])
    if config["replay_endpoint"] is not None:
        config["replay_endpoint"] = _endpoint("replay_endpoint", config["replay_endpoint"])
        _check_ports_differ(config)
    for field, (low, high, what) in _INTS.items():
        config[field] = _int(field, config[field], low, high, what)
    config["topic"] = _text("topic", config["topic"], "a topic string, e.g. \"kv-events\" (or \"\" for none)")
    if config["format"] not in FORMATS:
        raise ConfigError(
            f"{FLAG} format={json.dumps(config['format'])} is not a format SGLang knows: set it to \"default\" "
            "(SGLang's) or \"dynamo\" (what Dynamo's KV router reads: hashes namespaced by cache salt, LoRA names)"
        )
    if config["publisher"] == "null":
        return None
    config["block_size"] = page_size
    return config


def _text(field: str, value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{FLAG} {field}={json.dumps(value)} is not a string: set it to {what}")
    return value


def _publisher(value: Any) -> str:
    value = _text("publisher", value, "\"zmq\", or \"null\" (a string) to turn events off")
    if value not in ("zmq", "null"):
        raise ConfigError(
            f"{FLAG} publisher={json.dumps(value)} is not one sglang-kvbm can serve: set it to \"zmq\" (the wire Dynamo's "
            "router reads), or \"null\" to turn events off"
        )
    return value


def _endpoint(field: str, value: Any) -> str:
    value = _text(field, value, "a ZMQ address, e.g. \"tcp://*:5557\"")
    fix = f"set {field} to tcp://host:port (e.g. \"tcp://*:5557\" to bind every interface), ipc://path or inproc://name"
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest.strip():
        raise ConfigError(f"{FLAG} {field}={json.dumps(value)} is not a ZMQ address: {fix}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or any(c.isspace() for c in host) or not _port_ok(port):
            raise ConfigError(f"{FLAG} {field}={json.dumps(value)} needs a host and a port from 0 to 65535 (or *): {fix}")
    return value


def _port_ok(port: str) -> bool:
    return port == "*" or (port.isascii() and port.isdigit() and int(port) <= 65535)


def _bind(value: Any) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(
        f"{FLAG} bind={json.dumps(value)} is not a boolean: set it to true (bind the address), false (connect to "
        "it), or leave it out to bind wildcard, ipc and inproc addresses and connect to others"
    )


def _int(field: str, value: Any, low: Optional[int], high: Optional[int], what: str) -> int:
    number: Optional[int] = None
    if isinstance(value, bool):
        number = int(value)  # SGLang (pydantic) reads true as 1
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        number = int(value.strip())
    fix = f"set it to {what}, e.g. {DEFAULTS[field]} (the default)"
    if number is None:
        raise ConfigError(f"{FLAG} {field}={json.dumps(value)} is not a whole number: {fix}")
    if (low is not None and number < low) or (high is not None and number > high):
        raise ConfigError(f"{FLAG} {field}={number} is out of range, and SGLang's publisher would fail on it: {fix}")
    return number


def _binds(endpoint: str, bind: Optional[bool]) -> bool:
    """Whether SGLang binds the PUB socket (its own heuristic when ``bind`` is unset)."""
    if bind is not None:
        return bind
    return any(s in endpoint for s in ("*", "::", "0.0.0.0")) or endpoint.startswith(("ipc://", "inproc://"))


def _check_ports_differ(config: dict) -> None:
    """The replay ROUTER always binds; it cannot take the address the PUB socket binds."""
    pub, replay = config["endpoint"], config["replay_endpoint"]
    if not _binds(pub, config["bind"]):
        return
    if pub.startswith("tcp://") and replay.startswith("tcp://"):
        (pub_host, _, pub_port), (replay_host, _, replay_port) = pub[6:].rpartition(":"), replay[6:].rpartition(":")
        wildcard = {"*", "0.0.0.0", "[::]", "::"}
        clash = pub_port == replay_port != "*" and (
            pub_host == replay_host or pub_host in wildcard or replay_host in wildcard
        )
    else:
        clash = pub == replay
    if clash:
        raise ConfigError(
            f"{FLAG} replay_endpoint={json.dumps(replay)} binds the address endpoint={json.dumps(pub)} binds: "
            "give it its own address, e.g. \"tcp://*:5558\""
        )
