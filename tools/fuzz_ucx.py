#!/usr/bin/env python3
"""The long run of gpushare's UCX fuzzing, by hand (CI runs a short one:
tests/test_fuzz_ucx.py).

Forged packed worker addresses and packed remote keys, made from this
machine's own, go through the real calls (``Client.connect``,
``Agent.connect``, ``Endpoint.unpack_remote_key``: gpushare's validation,
then UCX) in child processes with a network namespace of their own (root,
``unshare`` and ``ip`` needed).  A child that dies by a signal is reported
with the case that killed it, and a fresh child goes on after it.

    python tools/fuzz_ucx.py [--addresses N] [--keys N] [--local N] [--seed S] [--version v1|v2|both]

N is how many forged blobs of each kind at least (default 20000).  ``--local N``: N more
addresses and N keys of an agent on UCX's one-node transports, its peer proven as itself
(cma, and posix and sysv keys of its own segments; default 20000; 0 leaves them out).  Prints
the counts as JSON and exits 1 if any case crashed a child.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _ucx_fuzz_child as fuzz  # noqa: E402

# Random cases per unit of the children's "count" argument: the address run
# adds count / 4 more for the agent's address, the key run count / 4 forged
# maps and count / 4 envelope changes.  The fixed cases (one-byte changes,
# deletions, insertions, truncations) come on top, so each run makes more
# than asked.
_PER_COUNT = {"address": 1.25, "key": 1.5, "local-address": 1.0, "local-key": 1.5}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--addresses", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--local", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--version", choices=("v1", "v2", "both"), default="both",
                        help="UCX_ADDRESS_VERSION of the address runs (both: half each)")
    args = parser.parse_args()
    report: dict[str, dict] = {}
    crashed = False
    versions = ("v1", "v2") if args.version == "both" else (args.version,)
    kinds = [("address", args.addresses), ("key", args.keys)]
    if args.local:
        kinds += [("local-address", args.local), ("local-key", args.local)]
    for kind, wanted in kinds:
        runs = versions if kind == "address" else ("",)
        for version in runs:
            share = wanted / len(runs)
            count = max(1, int(share / _PER_COUNT[kind]) + 1)
            env = {"UCX_ADDRESS_VERSION": version} if version else {}
            start = time.monotonic()
            result = fuzz.fuzz(kind, args.seed, count, timeout=3600, **env)
            result["seconds"] = round(time.monotonic() - start, 1)
            report[f"{kind} {version}".strip()] = result
            crashed |= bool(result["crashes"])
            print(json.dumps({f"{kind} {version}".strip(): result}), flush=True)
    totals = {k: sum(r[k] for r in report.values() if k in r) for k in ("total", "refused", "ucx_error", "accepted")}
    totals["crashes"] = sum(len(r["crashes"]) for r in report.values())
    totals["addresses"] = sum(r["total"] for k, r in report.items() if k.startswith("address"))
    totals["keys"] = report["key"]["total"]
    totals["one-node"] = sum(r["total"] for k, r in report.items() if k.startswith("local"))
    print(json.dumps({"all": totals}), flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
