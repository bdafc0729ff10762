"""The server-argument table names every field of the installed SGLang's ServerArgs exactly once.

Run on every supported release (CI: 0.5.23; ``make compat``: 0.5.21 and 0.5.22). An SGLang upgrade that
adds a field fails here until someone decides what the field does to a block's identity; one that drops
a field fails until the table says which release lacks it.
"""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.srt.server_args import ServerArgs

from sglang_kvbm.integration.sglang import server_args_table as table

CLASSES = {"KV_BYTES": table.KV_BYTES, "KV_FILES": table.KV_FILES, "NAMESPACE": table.NAMESPACE,
           "NEITHER": table.NEITHER}
HOW = "classify them in server_args_table.py: KV_BYTES, KV_FILES, NAMESPACE or NEITHER"


def _fields() -> set[str]:
    fields = getattr(ServerArgs, "__struct_fields__", None)
    if fields is None:  # a dataclass in some SGLang versions
        import dataclasses

        fields = tuple(f.name for f in dataclasses.fields(ServerArgs))
    return set(fields)


def test_every_field_is_classified():
    unclassified = sorted(_fields() - set().union(*CLASSES.values()))
    assert not unclassified, (
        f"{len(unclassified)} ServerArgs field(s) of the installed SGLang are in no class of the table "
        f"(checked against {', '.join(table.SGLANG_VERSIONS)}): {', '.join(unclassified)}; {HOW}"
    )


def installed_release() -> str:
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("sglang")).base_version


def test_the_fields_the_installed_release_lacks_are_the_ones_the_table_says():
    lacks = set().union(*CLASSES.values()) - _fields()
    said = table.ABSENT_IN.get(installed_release(), frozenset())
    assert lacks == said, (
        f"the table names field(s) the installed ServerArgs lacks without saying so: {', '.join(sorted(lacks - said))}; "
        f"and says it lacks field(s) it has: {', '.join(sorted(said - lacks))}; fix ABSENT_IN in server_args_table.py "
        "(or check that SGLang renamed them)"
    )


def test_every_field_a_release_lacks_is_in_the_table():
    for release, lacks in table.ABSENT_IN.items():
        assert release in table.SGLANG_VERSIONS
        assert lacks <= set().union(*CLASSES.values()), f"{release}: {sorted(lacks - set().union(*CLASSES.values()))}"


def test_classes_are_disjoint():
    names = list(CLASSES)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = sorted(CLASSES[a] & CLASSES[b])
            assert not both, f"in both {a} and {b}: {', '.join(both)}; a field belongs to exactly one class"


def test_each_name_is_written_once():
    """A frozenset swallows a repeated literal; the source must not repeat one (a sign of a half-done edit)."""
    tree = ast.parse(Path(table.__file__).read_text())
    classes = [node for node in tree.body if isinstance(node, ast.AnnAssign) and node.target.id in CLASSES]
    written = [node.value for each in classes for node in ast.walk(each)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    repeated = sorted(name for name, n in collections.Counter(written).items() if n > 1)
    assert not repeated, f"written more than once in server_args_table.py: {', '.join(repeated)}"


def test_the_table_was_checked_against_the_installed_version():
    installed = installed_release()
    if installed not in table.SGLANG_VERSIONS:
        pytest.fail(f"SGLang {installed} is installed, the table was checked against {', '.join(table.SGLANG_VERSIONS)}: "
                    "re-read the fields whose help text changed, then add it to SGLANG_VERSIONS and ABSENT_IN")


def test_the_table_is_plain_data():
    """The core library imports without SGLang: the table must not import it."""
    code = ("import sys; import sglang_kvbm.integration.sglang.server_args_table as t; "
            "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), 'imports sglang'; "
            "assert all(isinstance(c, frozenset) for c in (t.KV_BYTES, t.KV_FILES, t.NAMESPACE, t.NEITHER))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_known_kv_inputs_are_in_the_identity():
    """The inputs issue 27 found missing from the identity (and the obvious ones) are KV classes."""
    assert {"quantization_param_path", "lora_paths", "speculative_draft_model_path", "model_path",
            "tokenizer_path"} <= table.KV_FILES
    assert {"mamba_ssm_dtype", "kv_cache_dtype", "dtype", "quantization", "load_format",
            "json_model_override_args", "tp_size", "pp_size", "speculative_draft_kv_cache_dtype"} <= table.KV_BYTES
    assert {"served_model_name", "page_size"} <= table.NAMESPACE
