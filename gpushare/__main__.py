"""Command line: ``gpushare demo`` and ``gpushare doctor``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpushare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="share a buffer between two processes and report path and speed")
    demo.add_argument("--size-mib", type=int, default=64, help="buffer size in MiB (default 64)")
    demo.add_argument("--repeat", type=int, default=5, help="transfers to time (default 5)")
    doctor = sub.add_parser("doctor", help="this machine's capabilities and the path each peer would get")
    doctor.add_argument("--json", action="store_true", help="print plain data as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from ._doctor import run_doctor

        return run_doctor(as_json=args.json)
    if args.command == "demo":
        if args.size_mib < 1 or args.repeat < 1:
            parser.error("--size-mib and --repeat must be at least 1")
        from ._demo import run_demo

        return run_demo(args.size_mib << 20, args.repeat)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
