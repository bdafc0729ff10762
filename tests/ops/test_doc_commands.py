"""Every shell block in the docs is marked, runs when it says it does, and names only what exists.

A shell block (```bash, ```sh, ```shell, ```console) in the README, ``docs/``, ``examples/`` or
``benchmarks/`` carries a marker on the line before its fence:

* ``<!-- doc-test: run -->``: run here, from the repository root with this environment's ``bin/`` first on
  ``PATH``, under ``bash -e`` (no pipefail), ``TMPDIR`` a scratch directory; it must exit 0.
* ``<!-- doc-test: covered <path> -->``: what the named test file (or ``Makefile``) runs; the file must exist
  and name the block's script or target.
* ``<!-- doc-test: names-only -->``: needs a GPU, several hosts, a real model, the network or a long-lived
  server; not run.

Every block, whatever its marker, is checked for the names it uses: each ``DYN_KVBM_*``/``SGLANG_KVBM_*``
variable is one the library reads (or accepts), each ``sglang-kvbm`` subcommand and its flags exist, each
flag given to ``python -m sglang.launch_server`` is SGLang's (or the version patch's). So a renamed flag,
variable, subcommand or key fails here, not in a user's terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL = ("bash", "sh", "shell", "console")
BLOCK = re.compile(r"^(?:<!-- doc-test: (?P<kind>run|names-only|covered (?P<by>\S+)) -->\n)?```(?P<lang>[a-z]*)\n"
                   r"(?P<body>.*?)^```\s*$", re.M | re.S)
VARIABLE = re.compile(r"\b(?:DYN_KVBM|SGLANG_KVBM)_[A-Z0-9_]*[A-Z0-9]\b")
PATCH_FLAGS = {"--enable-kvbm", "--kvbm-config"}  # what patches/sglang-v*-kvbm.patch adds to SGLang's
SEPARATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1", "<"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int
    kind: Optional[str]  # run, names-only, covered; None: unmarked
    by: Optional[str]
    body: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [p for p in found if p.is_file()]


def blocks() -> list[Block]:
    out = []
    for path in documents():
        text = path.read_text()
        for m in BLOCK.finditer(text):
            if m.group("lang") not in SHELL:
                continue
            kind = m.group("kind")
            kind = "covered" if kind and kind.startswith("covered") else kind
            out.append(Block(path, text.count("\n", 0, m.start("body")), kind, m.group("by"), m.group("body")))
    return out


BLOCKS = blocks()


def commands(body: str) -> list[list[str]]:
    """Each command of a block as words: continuation lines joined, comments dropped, split at separators."""
    joined = re.sub(r"\\\n", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote inside a JSON argument: split plainly
            words = line.split()
        current: list[str] = []
        for word in words:
            if word in SEPARATORS:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(word)
        if current:
            out.append(current)
    return out


def known_variables() -> set[str]:
    from sglang_kvbm.config import settings

    return {v.env for v in settings._VARS} | set(settings._KVBM_PASSTHROUGH)


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    from sglang_kvbm.ops.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def sglang_flags() -> set[str]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return set(parser._option_string_actions) | PATCH_FLAGS


def flags_of(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def cli_calls(words: list[str]) -> Optional[list[str]]:
    """The words after ``sglang-kvbm`` (or ``python -m sglang_kvbm.ops.cli``), if this command is one."""
    for i, word in enumerate(words):
        if word.endswith("sglang-kvbm") and not word.startswith(("-", "'", '"')) and "/" not in word.rstrip("/")[:-11]:
            return words[i + 1:]
        if word == "-m" and i + 1 < len(words) and words[i + 1] == "sglang_kvbm.ops.cli":
            return words[i + 2:]
    return None


def launch_server_args(words: list[str]) -> Optional[list[str]]:
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and words[i + 1] == "sglang.launch_server":
            return words[i + 2:]
    return None


def test_the_docs_have_shell_blocks_and_each_is_marked():
    assert len(BLOCKS) > 20, f"found only {len(BLOCKS)} shell blocks: is the pattern still right?"
    unmarked = [str(b) for b in BLOCKS if b.kind is None]
    assert not unmarked, (
        f"shell blocks without a doc-test marker (run, covered <test>, names-only) on the line before the fence: "
        f"{unmarked}")


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_variable_a_block_names_exists(block):
    known = known_variables()
    unknown = sorted(set(VARIABLE.findall(block.body)) - known)
    assert not unknown, f"{block}: no such variable {unknown} (docs/reference/configuration-variables.md lists them)"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_sglang_kvbm_command_and_flag_exists(block):
    parsers = None
    for words in commands(block.body):
        rest = cli_calls(words)
        if rest is None:
            continue
        if not rest or rest[0].startswith("-"):  # `sglang-kvbm --help` / `--version`
            continue
        parsers = parsers or cli_parsers()
        assert rest[0] in parsers, f"{block}: `sglang-kvbm {rest[0]}` is not a command ({sorted(parsers)})"
        flags = set(parsers[rest[0]]._option_string_actions)
        unknown = [f for f in flags_of(rest[1:]) if f not in flags]
        assert not unknown, f"{block}: `sglang-kvbm {rest[0]}` has no flag {unknown}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if "sglang.launch_server" in b.body], ids=str)
def test_every_launch_server_flag_is_sglangs(block):
    known = sglang_flags()
    for words in commands(block.body):
        rest = launch_server_args(words)
        if rest is not None:
            unknown = [f for f in flags_of(rest) if f not in known]
            assert not unknown, f"{block}: SGLang {_sglang_version()} has no flag {unknown}"


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "covered"], ids=str)
def test_a_covered_block_names_what_runs_it(block):
    by = ROOT / block.by
    assert by.is_file(), f"{block}: covered by {block.by}, which does not exist"
    text = by.read_text()
    scripts = re.findall(r"(?:examples|patches|benchmarks|\.ci)/[\w./-]+", block.body)
    targets = re.findall(r"\bmake ([\w-]+)", block.body)
    named = [s for s in scripts + targets if Path(s).name not in text and s not in text]
    assert not named, f"{block}: {block.by} does not run {named}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run"], ids=str)
def test_a_runnable_block_runs(block, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_KVBM_", "SGLANG_KVBM_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", "-e", "-c", block.body], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{block} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
