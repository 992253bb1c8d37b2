"""Share an array between torchrun ranks, with a key the ranks agree on.

torchrun (like Slurm's srun or mpirun) starts each rank as a separate
program, so the ranks hold different multiprocessing authkeys and refuse each
other's control connections.  One call after ``init_process_group`` fixes
that: ``gs.set_authkey_from_process_group()`` has rank 0 draw a fresh key and
the group broadcast it, so every rank holds it and nobody else sees it in
an environment variable or a file.

Rank 0 exports a NumPy array over shareable memory (``gs.zeros``) and a
torch CPU tensor, and broadcasts the two shares (plain, picklable data);
rank 1 opens both and checks their bytes.

Run (CPU, gloo backend):

    torchrun --standalone --nproc-per-node 2 examples/torchrun_share.py

``--without-key`` skips the key step, to show what it is for: rank 1's
opens are refused (AccessDeniedError), rank 0 prints "example failed" and
every rank exits with status 1 (so torchrun reports the failure).
"""

from __future__ import annotations

import argparse

# torch before gpushare: torch must not be loaded after gpushare has loaded
# UCX (see docs/ucx.md).
import torch
import torch.distributed as dist

import numpy as np

import gpushare as gs

N = 1 << 16


def expected_array() -> np.ndarray:
    return (np.arange(N, dtype=np.uint32) * 2654435761).astype(np.uint32)


def expected_tensor() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) / 7


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without-key", action="store_true", help="do not agree on a key (the opens fail)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not args.without_key:
        gs.set_authkey_from_process_group()  # every rank: a collective
    shares: list = [None, None]
    if rank == 0:
        array = gs.zeros(N, np.uint32)  # host memory other processes can map
        array[...] = expected_array()
        tensor = expected_tensor()  # a plain torch CPU tensor
        shares = [gs.export(array, lifetime="revoked"), gs.export(tensor, lifetime="revoked")]
    dist.broadcast_object_list(shares, src=0)
    failed = 0
    if rank == 1:
        for name, share, want in (("array", shares[0], expected_array().tobytes()),
                                  ("tensor", shares[1], expected_tensor().numpy().tobytes())):
            try:
                with gs.open(share, timeout=30) as view:
                    got = np.empty(view.nbytes, np.uint8)
                    view.get(got)
                    match = got.tobytes() == want
                    print(f"rank 1: {name} of rank 0 via {view.path}: bytes match: {match}", flush=True)
                    failed += not match
            except gs.AccessDeniedError as exc:
                print(f"rank 1: {name} of rank 0 refused: {exc}", flush=True)
                failed += 1
    outcome = torch.tensor([failed])
    dist.all_reduce(outcome)  # also: rank 0 keeps its shares until rank 1 is done
    ok = outcome.item() == 0
    if rank == 0:
        for share in shares:
            share.revoke()
        print(f"{world} ranks: {'ok' if ok else 'example failed'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
