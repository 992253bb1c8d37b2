"""Command line: ``gpushare demo`` and ``gpushare doctor``."""

from __future__ import annotations

import argparse
import sys

from ._demo import run_demo
from ._doctor import run_doctor
from ._version import __version__

__all__ = ["main"]

_DESCRIPTION = "Share GPU and host buffers between processes, on one GPU, one node or across nodes."


def main(argv: list[str] | None = None) -> int:
    """Run the ``gpushare`` command line; return its exit status."""
    parser = argparse.ArgumentParser(prog="gpushare", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"gpushare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,doctor}")
    demo = sub.add_parser(
        "demo", help="share a buffer between two processes and report path and speed",
        description="Export a buffer (on the GPU if there is one), open it in a second process through the best "
                    "path, copy out and in, check every byte and report path, reason and throughput; then the "
                    "same over UCX RMA. Exits 1 if the data did not match. Progress goes to stderr on long runs.")
    demo.add_argument("--size-mib", type=int, default=64, help="buffer size in MiB (default 64)")
    demo.add_argument("--repeat", type=int, default=5, help="transfers to time (default 5)")
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object")
    doctor = sub.add_parser(
        "doctor", help="this machine's capabilities and the path each peer would get",
        description="Print this machine's capabilities (CUDA, IMEX, UCX transports, versions) and the path a "
                    "peer on this node or another would get, and why; then share a small buffer with a second "
                    "process over each path that host memory can take. Exits 1 if no path works between two "
                    "processes on this node.")
    doctor.add_argument("--json", action="store_true", help="print plain data as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return run_doctor(as_json=args.json)
    if args.command == "demo":
        if args.size_mib < 1 or args.repeat < 1:
            parser.error("--size-mib and --repeat must be at least 1")
        # Each copy's progress, as one line rewritten in place, only on a terminal.
        bar = sys.stdout if sys.stdout.isatty() and not args.json else None
        return run_demo(args.size_mib << 20, args.repeat, as_json=args.json, bar=bar)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
