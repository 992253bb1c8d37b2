"""How much host memory this machine can ever hold, and the refusal of an
allocation beyond it.

A memfd or anonymous mapping of any size is accepted by the kernel at once
(it commits nothing until a page is touched), so a size beyond the machine
would only fail when written: the process filling memory until the
out-of-memory killer ends it.  :func:`check_host` refuses such a size
before anything is made.
"""

from __future__ import annotations

from ._errors import OutOfMemoryError

__all__ = ["check_host", "host_limit", "human"]

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
