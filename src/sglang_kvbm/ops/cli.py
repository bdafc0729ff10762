"""The ``sglang-kvbm`` command line: ``doctor``, ``demo``, ``events`` and the tiers' own commands.

Building the parser imports no optional package (the tiers' kind modules are
light by rule: ``tiers.registry``), so ``--help`` and ``--version`` work on the
base install. Each command checks what it needs when it runs
(``base.needs.require``): a missing package is one line on stderr with the
``pip install`` that brings it, and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata
from typing import Optional, Sequence

from sglang_kvbm.base.needs import DISTRIBUTION, MissingPackage, installed, pip_install, require
from sglang_kvbm.base.versions import SUPPORTED_SGLANG, VERSION
from sglang_kvbm.tiers import registry

DESCRIPTION = """\
sglang-kvbm: NVIDIA Dynamo KVBM's KV cache tiers (host memory, disk, a shared store)
and KV events for SGLang. A server uses them through SGLang's --radix-cache-backend kvbm,
configured by DYN_KVBM_* variables; these commands check a machine, show what the tiers
do, and relay events."""


def _epilog() -> str:
    lines = [
        "what each command needs:",
        "  doctor             the base install",
        f"  demo, events       SGLang: {pip_install('sglang')}",
        f"  mooncake-events    pyzmq: {pip_install('mooncake')}",
        "",
        "'sglang-kvbm COMMAND --help' shows a command's options.",
        "Documentation: the docs/ folder of the source repository (start at docs/index.md)",
    ]
    url = _docs_url()
    if url:
        lines.append(f"  online: {url}")
    return "\n".join(lines)


def _docs_url() -> Optional[str]:
    """The package metadata's Documentation URL, if it has one (not in a source tree on PYTHONPATH)."""
    try:
        urls = metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("documentation", "docs"):
            return url.strip()
    return None


def _versions() -> str:
    supported = f"(this release supports sglang{SUPPORTED_SGLANG})"
    if not installed("sglang"):
        return f"{DISTRIBUTION} {VERSION}\nSGLang not installed {supported}"
    try:
        found = metadata.version("sglang")
    except metadata.PackageNotFoundError:  # importable without metadata: a source tree on the path
        found = "(version unknown)"
    return f"{DISTRIBUTION} {VERSION}\nSGLang {found} {supported}"


class _Version(argparse.Action):
    """``--version``: this package's version and the SGLang found, read when asked (not when the parser is built)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_versions())  # stdout, as argparse's own version action
        parser.exit()


def _positive_int(raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a positive whole number of bytes, e.g. --block-bytes 2097152")
    return value


def _command(sub, name: str, help: str, description: str = "") -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-kvbm", description=DESCRIPTION, epilog=_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, help="print the versions of sglang-kvbm and of the SGLang "
                        "installed, and exit")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    doctor = _command(
        sub, "doctor", "check versions, CUDA, configuration, memory and the disk directory",
        "Check this machine before serving: versions, CUDA, every DYN_KVBM_* variable, host memory and disk space "
        "against the configured tiers, the disk directory probed as the server will, and each tier the "
        "configuration turns on. Exit status 1 when there is a problem.",
    )
    doctor.add_argument(
        "--block-bytes",
        type=_positive_int,
        metavar="BYTES",
        help="the model's KV block size (the server logs it at start-up): checks tiers sized in blocks exactly",
    )
    doctor.add_argument(
        "--page-size",
        type=_positive_int,
        metavar="TOKENS",
        help="the server's --page-size: sizes each disk block's header (token ids) as the server will",
    )
    demo = _command(
        sub, "demo", "stock SGLang vs SGLang + kvbm on CPU, one table",
        "Start stock SGLang and SGLang with --radix-cache-backend kvbm on CPU, on a small model made locally, run "
        f"the same multi-turn workload on both and print one table. Needs SGLang: {pip_install('sglang')}",
    )
    demo.add_argument("--out", default="demo-out", help="where the model and server logs go")
    events = _command(
        sub, "events", "watch a worker's KV event stream, decoded, with per-tier counts",
        "Subscribe to a worker's KV event stream and print each event decoded, with the blocks each tier holds. "
        f"Needs SGLang: {pip_install('sglang')}",
    )
    events.add_argument("endpoint", help="the worker's --kv-events-config endpoint, e.g. tcp://127.0.0.1:5557")
    events.add_argument("--replay", metavar="ENDPOINT", help="its replay_endpoint: print the buffered history first")
    events.add_argument("--seconds", type=float, help="stop after this long without (or with) events")
    registry.add_commands(sub)  # the tiers' own (the shared tier's event relay)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.command == "doctor" else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(parser, args)
    except MissingPackage as exc:
        print(exc, file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "demo":
        require("demo", "sglang", "sglang", "requests", "transformers", "tokenizers")
        from sglang_kvbm.ops.demo.run import main as demo_main

        return demo_main(args.out)
    if args.command == "doctor":
        from sglang_kvbm.ops.doctor import main as doctor_main

        return doctor_main(sys.stdout, block_bytes=args.block_bytes, page_size=args.page_size)
    if args.command == "events":
        require("events", "sglang", "sglang", "zmq")
        from sglang_kvbm.integration.sglang.events_view import watch

        try:
            return watch(args.endpoint, replay_endpoint=args.replay, seconds=args.seconds)
        except TimeoutError as exc:  # a replay endpoint that does not answer: one line, not a traceback
            print(f"sglang-kvbm events: {exc}: is --replay the worker's replay_endpoint, and is the worker up?",
                  file=sys.stderr)
            return 1
    result = registry.run_command(args)
    if result is not None:
        return result
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
