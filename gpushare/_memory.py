"""How much host memory this machine can ever hold, and the refusal of an
allocation beyond it.

A memfd or anonymous mapping of any size is accepted by the kernel at once
(it commits nothing until a page is touched), so a size beyond the machine
would only fail when written: the process filling memory until the
out-of-memory killer ends it.  :func:`check_host` refuses such a size
before anything is made.  :func:`check_memfd` checks a memfd that came
from another process before it is mapped.
"""

from __future__ import annotations

import fcntl
import os
import stat

from ._errors import InvalidInputError, OutOfMemoryError

__all__ = ["check_host", "check_memfd", "host_limit", "human"]

_MEMINFO = "/proc/meminfo"


def host_limit() -> tuple[int, int] | None:
    """(RAM, swap) of this machine in bytes (``MemTotal``, ``SwapTotal``),
    or None where /proc/meminfo cannot be read."""
    fields: dict[str, int] = {}
    try:
        with open(_MEMINFO) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "SwapTotal"):
                    fields[name] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields:
        return None
    return fields["MemTotal"], fields.get("SwapTotal", 0)


def check_host(size: int) -> None:
    """Raise :class:`OutOfMemoryError` if ``size`` bytes of host memory are
    more than this machine's RAM and swap together."""
    limit = host_limit()
    if limit is None:
        return
    ram, swap = limit
    if size > ram + swap:
        raise OutOfMemoryError(
            f"{size} bytes ({human(size)}) of host memory is more than this machine can hold: "
            f"{human(ram)} of RAM and {human(swap)} of swap"
        )


def human(n: int) -> str:
    """``n`` bytes in binary units: ``"8.0 TiB"``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"


def check_memfd(fd: int, size: int, what: str, says: str) -> int:
    """Refuse ``fd`` (``what``, for the message) unless it is a regular file
    of ``size`` bytes sealed against shrinking (so that a mapping of it
    cannot lose pages under it); returns its seals.  ``says``: where the
    size was told, for the message."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInputError(f"{what} is not a regular file (mode {st.st_mode:o})")
    if st.st_size != size:
        raise InvalidInputError(f"{what} is {st.st_size} bytes; {says} {size}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidInputError(f"{what} is not sealed against shrinking; refusing to map it")
    return seals
