"""The error hierarchy, and the one place native failures are translated.

Every error gpushare raises derives from :class:`GpuShareError`.  Errors about
input (a malformed descriptor, a key blob from another process, an argument
out of range) also derive from :class:`ValueError`, and an argument of the
wrong type (:class:`InvalidTypeError`) from :class:`TypeError` as well; errors about a peer that
went away also derive from :class:`ConnectionError`; timeouts from
:class:`TimeoutError`.  Native UCX failures are turned into subclasses of
:class:`UCXError` by :func:`translate` and nowhere else; they carry UCX's
status name (``"UCS_ERR_CONNECTION_RESET"``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GpuShareError",
    "ClosedError",
    "InvalidInputError",
    "InvalidTypeError",
    "OutOfBoundsError",
    "WaitTimeoutError",
    "UCXError",
    "UCXConnectionError",
    "UCXCanceledError",
    "UCXTimeoutError",
    "UCXInvalidError",
    "UCXUnsupportedError",
    "UCXLibraryError",
    "AccessDeniedError",
    "ChannelBrokenError",
    "ExporterUnreachableError",
    "UnsupportedError",
    "CUDAError",
    "CUDAOutOfMemoryError",
    "OutOfMemoryError",
    "SlowPathWarning",
    "translate",
]


class GpuShareError(Exception):
    """Base class of every error raised by gpushare."""


class ClosedError(GpuShareError):
    """The object (agent, endpoint, handle, key, view) was closed before this use."""


class InvalidInputError(GpuShareError, ValueError):
    """Input failed validation: a descriptor, key or address from another
    process, or an argument of the wrong type, size or range."""


class InvalidTypeError(InvalidInputError, TypeError):
    """An argument of the wrong type: ``gpushare.open("x")``, ``gpushare.export(object())``.

    Also a :class:`TypeError` (Python's convention for a wrong type) and an
    :class:`InvalidInputError`, so ``except ValueError`` and ``except
    InvalidInputError`` clauses written before it still catch it.  The message
    names what was expected and what was given."""


class OutOfBoundsError(InvalidInputError):
    """A transfer would touch memory outside the range a remote key or buffer covers."""


class WaitTimeoutError(GpuShareError, TimeoutError):
    """A wait on a request ran past its timeout.  The request stays in flight."""


class _StatusError(GpuShareError):
    """An error that carries the status name of the library that reported it."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{message} [{status}]")
        self.status = status
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as (status, message), so it crosses multiprocessing intact.
        return type(self), (self.status, self.message)


class UCXError(_StatusError):
    """A failure reported by UCX.

    Attributes
    ----------
    status : str
        UCX's status name, for example ``"UCS_ERR_CONNECTION_RESET"``.
    """


class UCXConnectionError(UCXError, ConnectionError):
    """The peer is unreachable, disconnected or dead."""


class UCXCanceledError(UCXError):
    """The request was canceled, usually because its endpoint or agent closed."""


class UCXTimeoutError(UCXError, TimeoutError):
    """UCX gave up waiting (``UCS_ERR_TIMED_OUT``)."""


class UCXInvalidError(UCXError, ValueError):
    """UCX refused an argument (a corrupt key or address, a bad parameter)."""


class UCXUnsupportedError(UCXError):
    """The operation or memory type is not supported by the transports UCX found."""


class UCXLibraryError(GpuShareError, ImportError):
    """The UCX in this process is not the one gpushare was built for: another
    copy (a system UCX) is mapped, or its version differs.  The message names
    the file and version found and what to do."""


_CONNECTION = {
    "UCS_ERR_CONNECTION_RESET",
    "UCS_ERR_UNREACHABLE",
    "UCS_ERR_NOT_CONNECTED",
    "UCS_ERR_ENDPOINT_TIMEOUT",
    "UCS_ERR_LINK_FAILURE",
    "UCS_ERR_ENDPOINT_FAILURE",
    "UCS_ERR_IO_ERROR",
    "UCS_ERR_REJECTED",
    "UCS_ERR_SOME_CONNECTS_FAILED",
}
_BY_STATUS: dict[str, type[UCXError]] = {
    **dict.fromkeys(_CONNECTION, UCXConnectionError),
    "UCS_ERR_CANCELED": UCXCanceledError,
    "UCS_ERR_TIMED_OUT": UCXTimeoutError,
    "UCS_ERR_INVALID_PARAM": UCXInvalidError,
    "UCS_ERR_INVALID_ADDR": UCXInvalidError,
    "UCS_ERR_UNSUPPORTED": UCXUnsupportedError,
    "UCS_ERR_NOT_IMPLEMENTED": UCXUnsupportedError,
    "UCS_ERR_NO_DEVICE": UCXUnsupportedError,
}


def translate(status: str, message: str) -> GpuShareError:
    """Return the error for a native status name.

    UCX statuses (``UCS_*``) become :class:`UCXError` subclasses.  Refusals
    of a region server (``GS_ERR_*``, see ``gpushare._ucx._server``) become
    :class:`AccessDeniedError`, :class:`OutOfBoundsError`,
    :class:`ClosedError` or :class:`InvalidInputError`; they carry the
    status name too.
    """
    gs = _BY_GS_STATUS.get(status)
    if gs is not None:
        exc = gs(message)
        exc.status = status
        return exc
    return _BY_STATUS.get(status, UCXError)(status, message)


class AccessDeniedError(GpuShareError, PermissionError):
    """An exporter refused an import: wrong token, or a peer whose credentials
    (user id) may not receive the memory."""


class ExporterUnreachableError(GpuShareError, ConnectionError):
    """The exporting process cannot be reached to hand over its memory: it
    exited, closed the buffer, or did not answer in time."""


class ChannelBrokenError(GpuShareError, ConnectionError):
    """A channel cannot go on: its producer or one of its consumers died or
    left without closing the channel.  The message names the process."""


class UnsupportedError(GpuShareError):
    """This path cannot serve this buffer or peer here: another node, a handle
    type the device or driver lacks, no CUDA driver.  The message says which."""


class OutOfMemoryError(GpuShareError, MemoryError):
    """The memory asked for cannot be had: more host memory than this machine
    holds (RAM and swap), or a CUDA device out of memory.  The message names
    the size."""


class CUDAError(_StatusError):
    """A failure reported by the CUDA driver.

    The driver's ``CUDA_ERROR_OUT_OF_MEMORY`` is a
    :class:`CUDAOutOfMemoryError`, also an :class:`OutOfMemoryError`,
    wherever it is raised.

    Attributes
    ----------
    status : str
        The driver's status name, for example ``"CUDA_ERROR_INVALID_VALUE"``.
    """

    def __new__(cls, status: str, message: str) -> CUDAError:
        if cls is CUDAError and status == "CUDA_ERROR_OUT_OF_MEMORY":
            cls = CUDAOutOfMemoryError
        # Exception's own __new__: MemoryError's refuses a class whose first base is not it.
        return Exception.__new__(cls, status, message)


class CUDAOutOfMemoryError(CUDAError, OutOfMemoryError):
    """The CUDA driver is out of device memory (``CUDA_ERROR_OUT_OF_MEMORY``)."""


# Refusals and protocol failures of the region server (gpushare._ucx._server).
_BY_GS_STATUS: dict[str, type[GpuShareError]] = {
    "GS_ERR_ACCESS_DENIED": AccessDeniedError,
    "GS_ERR_READ_ONLY": AccessDeniedError,
    "GS_ERR_OUT_OF_BOUNDS": OutOfBoundsError,
    "GS_ERR_CLOSED": ClosedError,
    "GS_ERR_BAD_REQUEST": InvalidInputError,
    "GS_ERR_BAD_REPLY": InvalidInputError,
    "GS_ERR_FORKED": UnsupportedError,  # UCX in a child forked after its parent started UCX
}


class SlowPathWarning(UserWarning):
    """:func:`gpushare.open` fell back to a slower path than this pair could use.

    Turn it into an error with ``warnings.simplefilter("error", gpushare.SlowPathWarning)``.
    """
