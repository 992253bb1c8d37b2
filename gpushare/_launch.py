"""Keys for launchers: ranks that torchrun, Slurm or MPI start as separate
programs agree on one fresh control key over their process group.

Such ranks do not share a multiprocessing authkey, so without a common key
every open between them is refused.  :func:`set_authkey_from_process_group`
gives each rank the same key without it ever passing through the
environment, a file or a command line: rank 0 draws it, the group
broadcasts it (a collective, as any other), every rank sets it.

torch is imported only when the function is called: gpushare does not load
it at import.
"""

from __future__ import annotations

import secrets
from typing import Any

from ._auth import set_authkey
from ._errors import InvalidInputError, UnsupportedError

__all__ = ["KEY_BYTES", "set_authkey_from_process_group"]

KEY_BYTES = 32


def set_authkey_from_process_group(group: Any = None) -> None:
    """Give every rank of a torch.distributed process group one fresh key.

    A collective: every rank of ``group`` must call it, as for
    ``torch.distributed.broadcast``.  Rank 0 of the group draws
    32 random bytes (:mod:`secrets`), the group broadcasts them, and every
    rank passes them to :func:`gpushare.set_authkey`.  The key is not
    returned, printed or put in the environment.  Call it after
    ``torch.distributed.init_process_group`` and before the ranks export or
    open shares.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The group whose ranks share memory; by default the default
        (world) group.

    Raises
    ------
    UnsupportedError
        torch is not installed, or is built without torch.distributed.
    InvalidInputError
        No process group is initialized, or this process is not a member of
        ``group``.

    Notes
    -----
    The key is as secret as the group's traffic: whoever can join the
    group's rendezvous (its ``TCPStore``, which is not authenticated) or read
    its collectives can learn it.  See docs/security.md, "Keys for launchers".
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise UnsupportedError(f"set_authkey_from_process_group needs torch (pip install torch): {exc}") from None
    if not dist.is_available():
        raise UnsupportedError("this torch is built without torch.distributed")
    if not dist.is_initialized():
        raise InvalidInputError(
            "no torch.distributed process group is initialized; call torch.distributed.init_process_group "
            "first (torchrun sets the environment it reads)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidInputError("this process is not a member of the process group it was given")
    source = 0 if group is None else dist.get_global_rank(group, 0)
    # nccl broadcasts only CUDA tensors; gloo and mpi take CPU ones.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    if rank == 0:
        key = torch.tensor(list(secrets.token_bytes(KEY_BYTES)), dtype=torch.uint8, device=device)
    else:
        key = torch.zeros(KEY_BYTES, dtype=torch.uint8, device=device)
    dist.broadcast(key, src=source, group=group)
    set_authkey(bytes(key.cpu().tolist()))
