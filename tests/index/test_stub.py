"""``src/sglang_kvbm/_blocks.pyi`` is what nanobind's stubgen makes of the build under test (``make stubs``)."""

from pathlib import Path

import blocks_under_test  # noqa: F401 - the build under test, before the index
from nanobind.stubgen import StubGen

import sglang_kvbm._blocks

STUB = Path(__file__).resolve().parents[2] / "src" / "sglang_kvbm" / "_blocks.pyi"


def test_the_stub_is_the_one_the_extension_makes():
    made = StubGen(sglang_kvbm._blocks, quiet=True)
    made.put(sglang_kvbm._blocks)
    assert made.get() == STUB.read_text(), "src/sglang_kvbm/_blocks.pyi is stale: run make stubs"
