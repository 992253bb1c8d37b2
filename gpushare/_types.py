"""Names the API takes, as ``Literal`` types, and the one place spellings are normalised.

Path names and handle types are spelled with hyphens (``"posix-fd"``,
``"cuda-ipc"``); the older underscore spellings of handle types
(``"posix_fd"``, ``"cuda_ipc"``) still work and warn with
:class:`DeprecationWarning`.  ``device="cpu"`` is a synonym of ``"host"``.
"""

from __future__ import annotations

import warnings
from typing import Literal, TypeAlias

from ._errors import InvalidInputError

__all__ = [
    "PathName",
    "HandleType",
    "LifetimeName",
    "Lifetime",
    "Device",
    "PATH_NAMES",
    "HANDLE_TYPES",
    "handle_type",
    "internal_handle_type",
    "public_handle_types",
    "is_host",
]

#: A path between two processes, fastest first in :data:`PATH_NAMES`.
PathName: TypeAlias = Literal["same-process", "fabric", "posix-fd", "cuda-ipc", "host-fd", "cma", "ucx-rma"]
#: How same-node memory is handed over by :func:`gpushare.export_buffer`.
HandleType: TypeAlias = Literal["posix-fd", "fabric", "cuda-ipc"]
#: A named lifetime policy of :func:`gpushare.export`.
LifetimeName: TypeAlias = Literal["auto", "closed", "revoked", "none"]
#: A lifetime policy: a name, or a number of imports.
Lifetime: TypeAlias = LifetimeName | int
#: Where memory lives: a CUDA device ordinal, or host memory (``"cpu"`` is a synonym of ``"host"``).
Device: TypeAlias = int | Literal["host", "cpu"]

PATH_NAMES: tuple[PathName, ...] = ("same-process", "fabric", "posix-fd", "cuda-ipc", "host-fd", "cma", "ucx-rma")
#: Paths that do not map the memory: the importer copies with get/put.
COPIED_PATHS: tuple[PathName, ...] = ("cma", "ucx-rma")
HANDLE_TYPES: tuple[HandleType, ...] = ("posix-fd", "fabric", "cuda-ipc")
_OLD_HANDLE_TYPES = {"posix_fd": "posix-fd", "cuda_ipc": "cuda-ipc"}


def handle_type(value: object, *, stacklevel: int = 3) -> HandleType | None:
    """The canonical spelling of a handle type given by a caller (``None`` stays ``None``).

    Raises
    ------
    InvalidInputError
        Not a handle type.
    """
    if value is None:
        return None
    if isinstance(value, str) and value in _OLD_HANDLE_TYPES:
        new = _OLD_HANDLE_TYPES[value]
        warnings.warn(f"handle_type={value!r} is deprecated; spell it {new!r}, like the path of the same name",
                      DeprecationWarning, stacklevel=stacklevel)
        return new  # type: ignore[return-value]
    if isinstance(value, str) and value in HANDLE_TYPES:
        return value  # type: ignore[return-value]
    raise InvalidInputError(f"handle_type is {value!r:.40}; expected one of {', '.join(HANDLE_TYPES)} or None")


def internal_handle_type(value: str | None) -> str | None:
    """The spelling the CUDA modules use internally (``"posix_fd"``, ``"cuda_ipc"``)."""
    return None if value is None else value.replace("-", "_")


def public_handle_types(names: list[str]) -> list[str]:
    """Internal handle-type names in the public spelling."""
    return [n.replace("_", "-") for n in names]


def is_host(device: object) -> bool:
    """True for ``"host"`` and its synonym ``"cpu"``."""
    return isinstance(device, str) and device in ("host", "cpu")
