"""``sglang-kvbm`` as a person runs it: ``--version``, plain-text help, and on the base install (every optional
package made unimportable in a fresh interpreter) a missing package is one line with its ``pip install`` and exit
status 2, never a traceback; ``doctor`` reaches every row without torch."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

import sglang_kvbm
from sglang_kvbm.ops import cli

# What the base install lacks: the extras' packages, and what only SGLang brings.
OPTIONAL = ("sglang", "zmq", "nixl", "mooncake", "kvbm", "dynamo", "requests", "transformers", "tokenizers",
            "huggingface_hub", "packaging", "psutil", "tqdm")
# The base install's own dependencies: building the parser needs none of them either.
DECLARED = ("torch", "numpy", "msgspec", "xxhash", "prometheus_client")
REST = re.compile(r"``|:(?:class|func|meth|mod|data|attr):`")  # reST markup in what a person reads

# A fresh interpreter where the named modules cannot be imported (None in sys.modules: `import x` raises
# ModuleNotFoundError and importlib.util.find_spec('x') answers None), running the command line.
PROBE = """
import json, sys
blocked, argv = json.loads(sys.argv[1])
sys.modules.update(dict.fromkeys(blocked))
from sglang_kvbm.ops.cli import main
sys.exit(main(argv))
"""


def run_without(blocked, *argv, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_KVBM_", "SGLANG_KVBM_"))}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", PROBE, json.dumps([list(blocked), list(argv)])], env=env,
                          capture_output=True, text=True, timeout=60)


def commands() -> list[str]:
    (sub,) = [action for action in cli.build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return list(sub.choices)


# --- in process -----------------------------------------------------------------------------------------------


def test_version_names_this_package_and_the_sglang_found(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == f"sglang-kvbm {sglang_kvbm.__version__}"
    try:
        assert second.startswith(f"SGLang {metadata.version('sglang')} (this release supports sglang>=")
    except metadata.PackageNotFoundError:
        assert second.startswith("SGLang not installed")


def test_the_version_is_the_package_metadata():
    assert sglang_kvbm.__version__ == metadata.version("sglang-kvbm")


def test_help_is_plain_text_naming_every_command_and_the_docs(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert not REST.search(out), out
    assert "--version" in out and "docs/" in out
    for command in commands():
        assert command in out
    assert set(commands()) == {"doctor", "demo", "events", "mooncake-events"}


@pytest.mark.parametrize("command", ["doctor", "demo", "events", "mooncake-events"])
def test_every_command_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: sglang-kvbm {command}")
    assert not REST.search(out), out


# --- the base install, in a fresh interpreter ----------------------------------------------------------------


def test_the_parser_imports_nothing_outside_the_standard_library():
    """The command line and doctor import every tier's kind module: those stay light (tiers.registry)."""
    probe = (
        "import sys; before = set(sys.modules)\n"
        "from sglang_kvbm.tiers import registry; registry.kinds()\n"
        "import sglang_kvbm.ops.cli, sglang_kvbm.ops.doctor; sglang_kvbm.ops.cli.build_parser()\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - {'sglang_kvbm'} "
        "- set(sys.stdlib_module_names)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["doctor", "--help"], ["mooncake-events", "--help"]])
def test_help_and_version_work_with_only_the_standard_library(argv):
    run = run_without(OPTIONAL + DECLARED, *argv)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert "usage: sglang-kvbm" in run.stdout or run.stdout.startswith("sglang-kvbm ")
    if argv == ["--version"]:
        assert run.stdout.splitlines()[1].startswith("SGLang not installed")


@pytest.mark.parametrize("argv, line", [
    (["demo", "--out", "unused"], "sglang-kvbm demo needs SGLang, requests, transformers, tokenizers: "
                                  "pip install 'sglang-kvbm[sglang]'"),
    (["events", "tcp://127.0.0.1:9", "--seconds", "0.1"], "sglang-kvbm events needs SGLang, pyzmq: "
                                                            "pip install 'sglang-kvbm[sglang]'"),
    (["mooncake-events", "--master-http", "127.0.0.1:9"], "sglang-kvbm mooncake-events needs pyzmq: "
                                                            "pip install 'sglang-kvbm[mooncake]'"),
])
def test_a_missing_extra_is_one_line_with_its_fix(argv, line, tmp_path):
    run = run_without(OPTIONAL + ("torch",), *argv, env_extra={"HOME": str(tmp_path)})
    assert (run.returncode, run.stderr, run.stdout) == (2, line + "\n", "")
    fix = line.rpartition(": ")[2]
    assert fix in cli.build_parser().format_help()  # the top-level help says it too


def test_only_what_is_missing_is_named():
    run = run_without(("sglang",), "events", "tcp://127.0.0.1:9", "--seconds", "0.1")
    assert (run.returncode, run.stderr) == (2, "sglang-kvbm events needs SGLang: pip install 'sglang-kvbm[sglang]'\n")


def test_doctor_reaches_every_row_without_torch_or_any_extra(tmp_path):
    env = {"DYN_KVBM_CPU_CACHE_GB": "0.01", "DYN_KVBM_DISK_CACHE_GB": "0.01", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
           "SGLANG_KVBM_MOONCAKE_MASTER": "127.0.0.1:9", "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE",
           "DYN_KVBM_OBJECT_ENABLED": "1", "DYN_KVBM_OBJECT_BUCKET": "kv-cache", "DYN_KVBM_OBJECT_SECRET_KEY": "s3cr3t",
           "DYN_KVBM_OBJECT_ACCESS_KEY": "AKIAEXAMPLE"}
    run = run_without(OPTIONAL + ("torch",), "doctor", env_extra=env)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 1, run.stdout + run.stderr
    rows = {}
    for line in run.stdout.splitlines():
        check, _, rest = line.partition("  ")
        status, _, detail = rest.strip().partition("  ")
        rows.setdefault(check.strip(), (status, detail.strip()))
    assert rows["torch"][0] == "FAIL" and rows["torch"][1].startswith("not installed (required): pip install 'torch")
    assert rows["cuda"] == ("info", "not checked: torch is not installed")
    assert rows["sglang"][0] == "FAIL" and "not installed" in rows["sglang"][1]
    assert rows["nixl"] == ("info", "not installed (disk tier): pip install 'sglang-kvbm[disk]'")
    assert rows["host tier"][0] == "ok" and rows["disk tier"][0] == "ok", run.stdout
    assert rows["disk NIXL"] == ("FAIL", "the disk tier needs NIXL: pip install 'sglang-kvbm[disk]'")
    assert rows["G4 (Mooncake)"][0] == "FAIL" and "pip install 'sglang-kvbm[mooncake]'" in rows["G4 (Mooncake)"][1]
    assert rows["object backend"][0] == "FAIL" and "pip install 'sglang-kvbm[disk]'" in rows["object backend"][1]
    assert "s3cr3t" not in run.stdout and "AKIAEXAMPLE" not in run.stdout
    assert "DYN_KVBM_OBJECT_SECRET_KEY=<hidden>" in rows["configuration"][1]
    assert re.search(r"\n\d+ problem\(s\)$", run.stdout.rstrip())


def test_a_replay_endpoint_that_does_not_answer_is_one_line(tmp_path):
    """Found by the doc-command test: a --replay nobody serves was a traceback."""
    run = subprocess.run([sys.executable, "-m", "sglang_kvbm.ops.cli", "events", "tcp://127.0.0.1:9", "--replay",
                          "tcp://127.0.0.1:9", "--seconds", "0.1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("sglang-kvbm events: no replay from tcp://127.0.0.1:9") and "--replay" in run.stderr
