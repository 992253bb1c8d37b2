"""Training-data exchange between torch.distributed ranks through gpushare.

Each of N ranks (processes started by ``torch.multiprocessing.spawn``, which
uses the ``spawn`` start method) owns a buffer of N slots.  It fills its own
slot, exports the buffer and hands the :class:`gpushare.Share` to every other
rank with ``torch.distributed.all_gather_object`` (a share is plain,
picklable data).  Every rank then opens every other rank's share, reads the
whole buffer with ``view.get``, checks the owner's slot and writes its own
slot into it; after a barrier each rank finds every slot of its own buffer
filled: an all-gather done through shared memory rather than the collective.

Without CUDA (torch's CPU build works) the ranks use the gloo backend on
127.0.0.1 and share two buffers each: one on ``gpushare.allocate(...,
device="host")`` memory, which other ranks map (host-fd) and use as a
zero-copy tensor, and a plain torch CPU tensor, which the owner copies
into and out of the other ranks' buffers with the kernel's cross-memory
attach (cma: ``view.get`` / ``view.put``; ucx-rma across nodes).  With one CUDA
device per rank they use the nccl backend and a CUDA tensor on the rank's
device (legacy CUDA IPC on one node; ``torch.as_tensor(view)`` maps it).

Every share is exported with ``lifetime=N - 1``: each other rank opens it
once, after which the exporter lets it go.

Run: python examples/torch_distributed.py [--world-size N] [--cpu]
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import gpushare as gs

SLOT = 64 * 1024  # float32 elements per slot (256 KiB)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_data(rank: int, device: Any) -> torch.Tensor:
    """What ``rank`` puts in its slot."""
    return torch.arange(SLOT, dtype=torch.float32, device=device) + 1000.0 * (rank + 1)


def make_buffers(rank: int, world: int, use_cuda: bool) -> list[tuple[str, Any, torch.Tensor]]:
    """(name, object to export, tensor on its memory), own slot filled."""
    nbytes = world * SLOT * 4
    buffers: list[tuple[str, Any, torch.Tensor]]
    if use_cuda:
        device = torch.device("cuda", rank)
        tensor = torch.zeros(world, SLOT, dtype=torch.float32, device=device)
        buffers = [("cuda tensor", tensor, tensor)]
    else:
        host = gs.allocate(nbytes, device="host")
        mapped = torch.from_numpy(np.asarray(host).view(np.float32).reshape(world, SLOT))
        mapped.zero_()
        plain = torch.zeros(world, SLOT, dtype=torch.float32)
        buffers = [("allocated", host, mapped), ("tensor", plain, plain)]
    for _, _, tensor in buffers:
        tensor[rank] = slot_data(rank, tensor.device)
    if use_cuda:
        torch.cuda.synchronize(device)
    return buffers


def read_and_write(rank: int, owner: int, world: int, name: str, share: gs.Share, device: Any) -> bool:
    """Open ``owner``'s share, check its slot, write ours into it."""
    with gs.open(share) as view:
        whole = torch.empty(world, SLOT, dtype=torch.float32, device=device)
        view.get(whole)  # a copy, on every path
        ok = bool(torch.equal(whole[owner], slot_data(owner, device)))
        mine = slot_data(rank, device)
        zero_copy = ""
        if view.path in ("cma", "ucx-rma"):
            view.put(mine, offset=rank * SLOT * 4)  # flushed when put returns
        else:
            if view.device == "host":
                theirs = torch.from_numpy(np.asarray(view).view(np.float32).reshape(world, SLOT))
            else:
                theirs = torch.as_tensor(view).view(torch.float32).reshape(world, SLOT)
            seen = bool(torch.equal(theirs[owner], slot_data(owner, theirs.device)))
            theirs[rank] = mine.to(theirs.device)  # a store into the owner's memory
            if theirs.is_cuda:
                torch.cuda.synchronize(theirs.device)
            zero_copy = f", zero-copy read ok: {seen}"
            ok &= seen
            del theirs
        print(f"rank {rank}: {name} of rank {owner} via {view.path}: slot ok: {ok}{zero_copy}", flush=True)
        return ok


def run(rank: int, world: int, port: int, use_cuda: bool) -> None:
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        buffers = make_buffers(rank, world, use_cuda)
        mine = [(name, gs.export(obj, lifetime=max(world - 1, 1))) for name, obj, _ in buffers]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            for name, share in mine:
                print(f"rank 0: {name} offered on {', '.join(share.offers)}", flush=True)
        ok = True
        for owner in range(world):
            if owner == rank:
                continue
            for name, share in everyone[owner]:
                ok &= read_and_write(rank, owner, world, name, share, device)
        dist.barrier()  # every rank has written its slot everywhere
        for name, _, tensor in buffers:
            if use_cuda:
                torch.cuda.synchronize(device)
            full = all(torch.equal(tensor[r], slot_data(r, tensor.device)) for r in range(world))
            print(f"rank {rank}: {name}: all {world} slots filled: {full}", flush=True)
            ok &= full
        flags: list[Any] = [None] * world
        dist.all_gather_object(flags, ok)  # keep every exporter alive until all are done
        if not all(flags):
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    world = 2
    if "--world-size" in argv:
        world = int(argv[argv.index("--world-size") + 1])
    use_cuda = "--cpu" not in argv and torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks all run here
    print(f"{world} ranks, backend {'nccl' if use_cuda else 'gloo'}, "
          f"{'CUDA tensors' if use_cuda else 'host memory'}", flush=True)
    try:
        tmp.spawn(run, args=(world, free_port(), use_cuda), nprocs=world, join=True)
    except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as exc:  # a rank failed
        print(f"example failed: {exc}", flush=True)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
