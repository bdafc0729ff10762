"""``sglang-kvbm``: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from sglang_kvbm.tiers import registry


def _positive_int(raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a positive whole number of bytes, e.g. --block-bytes 2097152")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-kvbm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stock SGLang vs SGLang + kvbm on CPU, one table")
    demo.add_argument("--out", default="demo-out", help="where the model and server logs go")
    events = sub.add_parser("events", help="watch a worker's KV event stream, decoded, with per-tier counts")
    events.add_argument("endpoint", help="the worker's --kv-events-config endpoint, e.g. tcp://127.0.0.1:5557")
    events.add_argument("--replay", metavar="ENDPOINT", help="its replay_endpoint: print the buffered history first")
    events.add_argument("--seconds", type=float, help="stop after this long without (or with) events")
    registry.add_commands(sub)  # the tiers' own (the shared tier's event relay)
    doctor = sub.add_parser("doctor", help="check versions, CUDA, configuration, memory and the disk directory")
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
    args = parser.parse_args(argv)
    level = logging.WARNING if args.command == "doctor" else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")

    if args.command == "demo":
        from sglang_kvbm.ops.demo import main as demo_main

        return demo_main(args.out)
    if args.command == "doctor":
        from sglang_kvbm.ops.doctor import main as doctor_main

        return doctor_main(sys.stdout, block_bytes=args.block_bytes, page_size=args.page_size)
    if args.command == "events":
        from sglang_kvbm.integration.sglang.events_view import watch

        return watch(args.endpoint, replay_endpoint=args.replay, seconds=args.seconds)
    result = registry.run_command(args)
    if result is not None:
        return result
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
