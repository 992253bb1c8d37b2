"""``multiprocessing`` with arrays and tensors carried as gpushare shares.

A drop-in for :mod:`torch.multiprocessing`: a program that changes only its
import, ``import gpushare.multiprocessing as mp``, gets the whole
:mod:`multiprocessing` API (``get_context``, ``Process``, ``Queue``,
``Pipe``, ``Pool``, every start method), and torch tensors (CPU and CUDA),
CuPy arrays, :class:`gpushare.CudaArray` arrays, cuda.core ``Buffer``
objects and NumPy arrays over gpushare memory travel through its queues,
pipes, pools and ``concurrent.futures.ProcessPoolExecutor`` as gpushare
shares: all of one message as one bundle (one share, one open, one lease).
The receiver gets the same type back, zero-copy where the path maps memory.

Importing this module registers the reducers (with
``multiprocessing.reduction.ForkingPickler``); :func:`init_reductions` does
the same for a program that keeps ``import multiprocessing``.  A process
that unpickles a message imports this module, so spawned and forkserver
children register it too.  See docs/multiprocessing.md.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from . import _pickling
from ._pickling import outstanding

# The drop-in: every name of multiprocessing (its default context's functions
# and classes), as ``from multiprocessing import *`` would bind them.
_NAMES: list[str] = list(multiprocessing.__all__)  # type: ignore[attr-defined]
globals().update({_name: getattr(multiprocessing, _name) for _name in _NAMES})
__all__ = ["init_reductions", "outstanding", *_NAMES]

# Pickles name the rebuild functions here, so a process that unpickles a
# message imports this module, and with it registers the reducers.
open_carrier = _pickling.open_carrier
rebuild = _pickling.rebuild
revive = _pickling.revive
for _fn in (open_carrier, rebuild, revive, outstanding):
    _fn.__module__ = __name__
del _fn


def init_reductions() -> None:
    """Carry arrays and tensors through ``multiprocessing`` pickling as
    gpushare shares (idempotent; importing this module already did it).

    For a program that uses :mod:`multiprocessing` or
    :mod:`concurrent.futures` directly: call it once before the first put,
    send or submit.  Children need nothing: unpickling a message imports
    this module there.
    """
    _pickling.install()


init_reductions()


def __getattr__(name: str) -> Any:  # lets a type checker accept the names bound by the update above
    raise AttributeError(f"module 'gpushare.multiprocessing' has no attribute {name!r}")
