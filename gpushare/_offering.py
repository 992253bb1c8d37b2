"""What one buffer offers at export: its lifetime policy read, the memory
the paths serve (the gpushare.allocate buffer it lies in, where there is
one), its device; shared by the export of one buffer and of a bundle."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import _arrays, _paths
from ._cuda import _driver
from ._errors import InvalidInputError, InvalidTypeError
from ._paths.base import Memory
from ._share import LIFETIMES
from ._types import PathName

__all__ = ["PathList", "parse_lifetime", "memory_of", "device_ordinal"]

#: What ``paths=``, ``prefer=`` and ``exclude=`` take: path names, or one comma-separated str.
PathList = Iterable[PathName] | str


def parse_lifetime(lifetime: Any) -> tuple[Any, str]:
    if isinstance(lifetime, bool):
        raise InvalidTypeError("lifetime must be 'auto', 'closed', 'revoked', 'none' or a positive int, not bool")
    if isinstance(lifetime, int):
        if not 1 <= lifetime <= 999_999_999:
            raise InvalidInputError(f"lifetime={lifetime}: a number of imports must be between 1 and 999999999")
        return lifetime, f"imports={lifetime}"
    if lifetime in LIFETIMES:
        return lifetime, lifetime
    if not isinstance(lifetime, str):
        raise InvalidTypeError(f"lifetime must be 'auto', 'closed', 'revoked', 'none' or a positive int, not "
                               f"{type(lifetime).__name__}")
    raise InvalidInputError(f"lifetime must be 'auto', 'closed', 'revoked', 'none' or a positive int, not {lifetime!r}")


def memory_of(obj: Any, memory_type: str, span: tuple[int, int], readonly: bool, strided: bool) -> tuple[
        Memory, int]:
    """What the paths are offered: the gpushare.allocate buffer that holds
    ``span`` (address, nbytes) where there is one, and the span's offset in it."""
    offset = 0
    if isinstance(obj, _arrays.CudaArray) and obj.ptr == int(getattr(obj.base, "handle", -1)):
        obj = obj.base  # a gpushare.empty array: its buffer goes every way, typed as the array
    # An array (a CuPy or torch array, a slice, a typed view) over
    # gpushare.allocate memory: the importer maps the whole buffer and views its part.
    found = _paths.holder(obj, memory_type, span)
    if found is not None:
        obj, offset = found
    return Memory(obj, memory_type, readonly, strided), offset


def device_ordinal(address: int, hint: Any) -> int:
    """The CUDA device that owns ``address`` (asked of the driver)."""
    return _driver.pointer_ordinal(address, hint if isinstance(hint, int) and hint >= 0 else None)
