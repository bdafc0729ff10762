"""``--kv-events-config`` checked before SGLang starts: every field, good and bad, against SGLang's own parser.

Each case is ``(json, outcome)``: ``ok`` (SGLang takes it and so do we), ``off``
(valid, events off), or the text the ``ConfigError`` must contain (always the
field and the fix). Every case also goes through SGLang's ``KVEventsConfig``:
what SGLang refuses we refuse, and what we refuse that SGLang parses is listed
in ``STRICTER`` with the reason it would not run.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from conftest import needs
from sglang_kvbm.config import ConfigError
from sglang_kvbm.config.events import DEFAULTS, check_kv_events_config

ZMQ = {"publisher": "zmq"}


def zmq(**fields):
    return json.dumps({**ZMQ, **fields})


CASES = [
    # whole value
    (None, "off"),
    ("", "off"),
    ("{}", "off"),  # SGLang's default publisher is "null"
    ("{publisher: zmq}", "is not valid JSON"),
    ("[]", "must be a JSON object"),
    ("null", "must be a JSON object"),
    ('"zmq"', "must be a JSON object"),
    # publisher
    (zmq(), "ok"),
    ('{"publisher": "null"}', "off"),
    ('{"publisher": null}', "publisher=null is not a string"),
    ('{"publisher": "ZMQ"}', 'publisher="ZMQ" is not one sglang-kvbm can serve'),
    ('{"publisher": "kafka"}', 'publisher="kafka" is not one sglang-kvbm can serve: set it to "zmq"'),
    ('{"publisher": 1}', "publisher=1 is not a string"),
    # endpoint
    (zmq(endpoint="tcp://*:5557"), "ok"),
    (zmq(endpoint="tcp://127.0.0.1:6000"), "ok"),
    (zmq(endpoint="tcp://[::1]:6000"), "ok"),
    (zmq(endpoint="tcp://worker-3.local:6000"), "ok"),
    (zmq(endpoint="tcp://*:*"), "ok"),
    (zmq(endpoint="ipc:///tmp/kv-events"), "ok"),
    (zmq(endpoint="inproc://kv"), "ok"),
    (zmq(endpoint=None), "endpoint=null is not a string"),
    (zmq(endpoint=5557), "endpoint=5557 is not a string"),
    (zmq(endpoint=""), 'endpoint="" is not a ZMQ address'),
    (zmq(endpoint="localhost:5557"), "is not a ZMQ address: set endpoint to tcp://host:port"),
    (zmq(endpoint="udp://*:5557"), "is not a ZMQ address"),
    (zmq(endpoint="tcp://*"), "needs a host and a port"),
    (zmq(endpoint="tcp://:5557"), "needs a host and a port"),
    (zmq(endpoint="tcp://*:70000"), "needs a host and a port from 0 to 65535"),
    (zmq(endpoint="tcp://*:http"), "needs a host and a port"),
    (zmq(endpoint="ipc://"), "is not a ZMQ address"),
    # bind
    (zmq(bind=True), "ok"),
    (zmq(bind=False), "ok"),
    (zmq(bind=None), "ok"),
    (zmq(bind="yes"), "ok"),
    (zmq(bind="OFF"), "ok"),
    (zmq(bind=1), "ok"),
    (zmq(bind=2), "bind=2 is not a boolean: set it to true"),
    (zmq(bind="maybe"), "bind=\"maybe\" is not a boolean"),
    (zmq(bind=[]), "bind=[] is not a boolean"),
    # replay_endpoint
    (zmq(replay_endpoint="tcp://*:5558"), "ok"),
    (zmq(replay_endpoint=None), "ok"),
    (zmq(replay_endpoint=5558), "replay_endpoint=5558 is not a string"),
    (zmq(replay_endpoint="*:5558"), 'replay_endpoint="*:5558" is not a ZMQ address: set replay_endpoint'),
    (zmq(replay_endpoint="tcp://*:5557"), 'replay_endpoint="tcp://*:5557" binds the address'),
    (zmq(endpoint="tcp://127.0.0.1:5557", bind=True, replay_endpoint="tcp://*:5557"), "give it its own address"),
    (zmq(endpoint="tcp://10.0.0.9:5557", replay_endpoint="tcp://*:5557"), "ok"),  # PUB connects: no clash
    (zmq(endpoint="ipc:///tmp/a", replay_endpoint="ipc:///tmp/a"), "binds the address"),
    # buffer_steps, hwm, max_queue_size
    (zmq(buffer_steps=1, hwm=1, max_queue_size=1), "ok"),
    (zmq(buffer_steps=0, hwm=0, max_queue_size=0), "ok"),  # no history, no ZMQ limit, unbounded queue
    (zmq(buffer_steps="100", hwm=" 1_000 ", max_queue_size=1e3), "ok"),  # SGLang's lax integers
    (zmq(hwm=True), "ok"),  # pydantic reads true as 1
    (zmq(max_queue_size=-1), "ok"),  # Python's Queue: unbounded
    (zmq(buffer_steps=-1), "buffer_steps=-1 is out of range"),
    (zmq(hwm=-1), "hwm=-1 is out of range, and SGLang's publisher would fail on it: set it to a whole number from 0"),
    (zmq(hwm=1 << 31), "hwm=2147483648 is out of range"),
    (zmq(buffer_steps=1.5), "buffer_steps=1.5 is not a whole number: set it to"),
    (zmq(hwm="lots"), "hwm=\"lots\" is not a whole number"),
    (zmq(hwm="1e3"), "is not a whole number"),
    (zmq(max_queue_size=None), "max_queue_size=null is not a whole number"),
    (zmq(max_queue_size=[1]), "max_queue_size=[1] is not a whole number"),
    # topic
    (zmq(topic="kv-events"), "ok"),
    (zmq(topic=""), "ok"),
    (zmq(topic=5), "topic=5 is not a string: set it to a topic string"),
    (zmq(topic=None), "topic=null is not a string"),
    # format
    (zmq(format="default"), "ok"),
    (zmq(format="dynamo"), "ok"),
    (zmq(format="Dynamo"), 'format="Dynamo" is not a format SGLang knows: set it to "default"'),
    (zmq(format=None), "format=null is not a format"),
    # keys SGLang does not read: ignored, with a warning
    (zmq(endpont="tcp://*:1"), "ok"),
    # a bad field is reported even when events are off, as SGLang parses every field
    ('{"publisher": "null", "hwm": "lots"}', "hwm=\"lots\""),
]

# Parsed by SGLang, refused here (matched on the expected message): each would stop SGLang at start-up or
# kill its publisher thread.
STRICTER = {
    "is not one sglang-kvbm can serve": "SGLang's publisher registry has only 'null' and 'zmq', case-sensitive",
    "is not a ZMQ address": "ZMQ refuses the address at bind or connect",
    "needs a host and a port": "ZMQ refuses the address at bind or connect",
    "binds the address": "the replay ROUTER cannot bind an address the PUB socket binds",
    "give it its own address": "the replay ROUTER cannot bind an address the PUB socket binds",
    "is out of range": "deque(maxlen=-1) raises; ZMQ refuses an HWM outside 0 to 2**31 - 1",
}


def _stricter(expected: str) -> bool:
    return any(key in expected for key in STRICTER)


@pytest.mark.parametrize("raw, expected", CASES, ids=[str(raw) for raw, _ in CASES])
def test_kv_events_config(raw, expected, caplog):
    if expected in ("ok", "off"):
        config = check_kv_events_config(raw, page_size=16)
        assert (config is None) == (expected == "off")
        if config is not None:
            assert config["block_size"] == 16 and set(config) == set(DEFAULTS) | {"block_size"}
    else:
        with pytest.raises(ConfigError) as err:
            check_kv_events_config(raw, page_size=16)
        message = str(err.value)
        assert expected in message, message
        assert "--kv-events-config" in message
        assert any(word in message for word in ("set ", "pass ", "give ")), f"no fix in: {message}"


# SGLang 0.5.21's KVEventsConfig has neither `bind` nor `format` (the checks here follow 0.5.22 on: a release that has
# them); what 0.5.21 would do with them is its own parser's business.
_EVENTS_FIELDS_OF_0_5_22 = needs("event_dynamo_format")


@_EVENTS_FIELDS_OF_0_5_22
@pytest.mark.parametrize("raw, expected", [c for c in CASES if c[0]], ids=[str(c[0]) for c in CASES if c[0]])
def test_agrees_with_sglangs_parser(raw, expected):
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    try:
        theirs = KVEventsConfig.from_cli(raw).model_dump()
    except Exception:  # pydantic's ValidationError, or a JSON error
        theirs = None
    if expected in ("ok", "off"):
        assert theirs is not None, "we accept what SGLang refuses"
        ours = check_kv_events_config(raw, page_size=16)
        if ours is not None:
            assert {k: ours[k] for k in theirs} == theirs
    elif theirs is not None:
        assert _stricter(expected), f"SGLang accepts {raw}: refuse it only with a reason in STRICTER"


@_EVENTS_FIELDS_OF_0_5_22
def test_defaults_are_sglangs():
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    assert {name: f.default for name, f in KVEventsConfig.model_fields.items()} == DEFAULTS


def test_unknown_key_is_a_warning_naming_the_close_one(caplog):
    with caplog.at_level(logging.WARNING):
        check_kv_events_config(zmq(endpont="tcp://*:1"), page_size=4)
    assert "'endpont'" in caplog.text and "did you mean 'endpoint'" in caplog.text


@pytest.mark.parametrize("page_size", [0, -4, None, 2.0, True])
def test_page_size_must_be_positive(page_size):
    with pytest.raises(ConfigError, match="--page-size .*set --page-size to 1 or more"):
        check_kv_events_config(zmq(), page_size=page_size)


def test_imports_no_sglang():
    code = "import sys, sglang_kvbm.config.events; print([m for m in ('sglang', 'torch', 'zmq') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_print_the_table(capsys):
    """The table as a person reads it (``pytest -s tests/ops/test_events_config.py -k table``)."""
    for raw, expected in CASES:
        if expected in ("ok", "off"):
            continue
        with pytest.raises(ConfigError) as err:
            check_kv_events_config(raw, page_size=16)
        print(f"{raw} -> {err.value}")
