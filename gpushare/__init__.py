"""gpushare: hand a GPU or host buffer to another process, on this GPU, this
node or another node, as fast as the hardware allows, safely.

Importing this package starts no thread, sets no environment variable and
touches no GPU.  UCX is loaded the first time it is needed: a ucx-rma open
or export, or :mod:`gpushare.ucx` making an agent, server or client.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ._arena import Arena
from ._arrays import CudaArray, empty, empty_like, zeros
from ._auth import set_authkey
from ._batch import BatchRequest, get_batch, put_batch
from ._bundle import Bundle
from ._capabilities import capabilities
from ._channel.consumer import Consumer, Step, subscribe
from ._channel.handle import ChannelHandle
from ._channel.producer import Producer, channel
from ._descriptors import (
    CudaIpcBufferDescriptor,
    CudaPoolBufferDescriptor,
    PosixFdBufferDescriptor,
    VirtualMemoryFabricBufferDescriptor,
)
from ._errors import (
    AccessDeniedError,
    ChannelBrokenError,
    ClosedError,
    CUDAError,
    CUDAOutOfMemoryError,
    ExporterUnreachableError,
    GpuShareError,
    InvalidInputError,
    InvalidTypeError,
    OutOfBoundsError,
    OutOfMemoryError,
    SlowPathWarning,
    UCXCanceledError,
    UCXConnectionError,
    UCXError,
    UCXLibraryError,
    UCXInvalidError,
    UCXTimeoutError,
    UCXUnsupportedError,
    UnsupportedError,
    WaitTimeoutError,
)
from ._export import export
from ._by_descriptor import allocate, export_buffer, import_buffer
from ._launch import set_authkey_from_process_group
from ._layout import share_memory
from ._open import open, open_async
from ._paths.handles import HostBuffer
from ._share import BundleShare, Share
from ._version import __version__
from ._view import View

if TYPE_CHECKING:
    from typing import Any

    from . import ucx
del TYPE_CHECKING


# Library logging: silent unless the application configures logging
# (``logging.getLogger("gpushare").setLevel(logging.DEBUG)``).
logging.getLogger(__name__).addHandler(logging.NullHandler())
del logging

__all__ = [
    "__version__",
    "ClosedError",
    "GpuShareError",
    "InvalidInputError",
    "InvalidTypeError",
    "OutOfBoundsError",
    "UCXCanceledError",
    "UCXConnectionError",
    "UCXError",
    "UCXLibraryError",
    "UCXInvalidError",
    "UCXTimeoutError",
    "UCXUnsupportedError",
    "WaitTimeoutError",
    "ucx",
    "AccessDeniedError",
    "CUDAError",
    "CUDAOutOfMemoryError",
    "OutOfMemoryError",
    "Arena",
    "ChannelBrokenError",
    "ChannelHandle",
    "Consumer",
    "CudaArray",
    "Producer",
    "Step",
    "channel",
    "empty",
    "empty_like",
    "open_async",
    "subscribe",
    "zeros",
    "CudaIpcBufferDescriptor",
    "CudaPoolBufferDescriptor",
    "ExporterUnreachableError",
    "HostBuffer",
    "PosixFdBufferDescriptor",
    "UnsupportedError",
    "VirtualMemoryFabricBufferDescriptor",
    "allocate",
    "capabilities",
    "export_buffer",
    "import_buffer",
    "Share",
    "BundleShare",
    "Bundle",
    "SlowPathWarning",
    "View",
    "BatchRequest",
    "get_batch",
    "put_batch",
    "set_authkey",
    "set_authkey_from_process_group",
    "export",
    "share_memory",
]
# ``open`` is public (``gpushare.open``) but left out of ``__all__`` so that
# ``from gpushare import *`` does not shadow the builtin.

# Public classes and exceptions present themselves as ``gpushare.X`` (in
# tracebacks, reprs and the API reference), not as the private module that
# defines them.  Pickles refer to them by that name, which resolves here.
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) and _obj.__module__.startswith("gpushare."):
        _obj.__module__ = __name__
for _obj in (export, open, allocate, export_buffer, import_buffer, capabilities, channel, subscribe,
             open_async, empty, zeros, empty_like, get_batch, put_batch, set_authkey,
             set_authkey_from_process_group, share_memory):
    _obj.__module__ = __name__
del _name, _obj, annotations


def __getattr__(name: str) -> Any:
    if name == "ucx":  # loaded on first use: it brings in the native module
        import importlib

        return importlib.import_module(".ucx", __name__)
    raise AttributeError(f"module 'gpushare' has no attribute {name!r}")
