"""The UCX that gpushare runs on: the libucx wheel's, loaded by path, and checked in the process's mappings.

libucxx's own loader loads the libucx wheel's libraries only when ``import
librmm`` succeeds; without librmm, ``libucxx.so`` finds ``libucp.so.0``
wherever the dynamic loader looks first (``LD_LIBRARY_PATH``, then the
system's folders), and a system UCX of another version is taken with no
error until the first transfer fails.  So gpushare loads UCX itself, by
absolute path, each library after the ones it needs (``libucs``
with ``libucm``, ``libuct``, ``libucp``), then ``libucxx.so``; their ``NEEDED``
entries then resolve to the copies already loaded.  Before and after, it
reads ``/proc/self/maps``: a UCX library mapped from anywhere else, or a
version other than the one the native module was built against, is
refused with :class:`UCXLibraryError`, naming the file and version found.

``GPUSHARE_UCX_LIBRARY_DIR`` names another folder to load UCX from (a
cluster's own UCX built with InfiniBand support, which the wheel lacks);
its version must still match.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

from .._errors import UCXLibraryError

__all__ = ["UcxLibraries", "load", "check_built", "mapped_ucx", "wheel_dirs", "version_of", "LIBRARY_DIR_ENV"]

#: Names a folder holding libucm/libucs/libuct/libucp to load instead of the wheel's.
LIBRARY_DIR_ENV = "GPUSHARE_UCX_LIBRARY_DIR"

#: UCX's libraries in the order each needs the ones before it (libucs brings libucm, the two
#: needing each other, through its own RPATH, which the loader searches before LD_LIBRARY_PATH).
_ORDER = ("libucs.so.0", "libuct.so.0", "libucp.so.0")
_UCX_NAME = re.compile(r"^lib(ucm|ucs|uct|ucp)\.so(\.\d+)*$")


@dataclass(frozen=True)
class UcxLibraries:
    """What was loaded: UCX's folder and version, libucxx's file, and every UCX file mapped."""

    ucx_dir: str
    ucx_version: tuple[int, int, int]
    ucxx_file: str
    mapped: tuple[str, ...]


def wheel_dirs() -> tuple[str, str]:
    """The libucx wheel's library folder and the libucxx wheel's, real paths."""
    try:
        import libucx
        import libucxx
    except ImportError as exc:  # pragma: no cover - a broken install
        raise ImportError(
            "gpushare's UCX support needs the 'libucxx-cu13' package, which brings 'libucx-cu13' "
            "(pip install libucxx-cu13==0.52.*)"
        ) from exc
    return (os.path.realpath(os.path.join(os.path.dirname(libucx.__file__), "lib")),
            os.path.realpath(os.path.join(os.path.dirname(libucxx.__file__), "lib64")))


def mapped_ucx() -> list[str]:
    """The real paths of the UCX core libraries (libucm, libucs, libuct, libucp) this process has mapped."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                if _UCX_NAME.match(os.path.basename(path)):
                    real = os.path.realpath(path)
                    if real not in found:
                        found.append(real)
    except OSError:  # pragma: no cover - no procfs: nothing to check against
        return []
    return found


def version_of(library: ctypes.CDLL) -> tuple[int, int, int]:
    """The version a loaded ``libucp`` reports (``ucp_get_version``)."""
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    library.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    return (major.value, minor.value, release.value)


def _describe(paths: list[str]) -> str:
    """The UCX copies among ``paths``, by folder: "UCX 1.13.1 in /usr/lib (libucp.so.0.0.0, ...)"."""
    by_dir: dict[str, list[str]] = {}
    for p in paths:
        by_dir.setdefault(os.path.dirname(p), []).append(os.path.basename(p))
    out = []
    for folder, names in by_dir.items():
        ucp = next((n for n in names if n.startswith("libucp.so")), None)
        try:
            lib = ctypes.CDLL(os.path.join(folder, ucp), os.RTLD_NOLOAD | os.RTLD_LOCAL) if ucp else None
            version = ".".join(map(str, version_of(lib))) if lib is not None else "of unknown version"
        except (OSError, AttributeError):
            version = "of unknown version"
        out.append(f"UCX {version} in {folder} ({', '.join(sorted(names))})")
    return "; ".join(out)


def _foreign(ucx_dir: str) -> list[str]:
    return [p for p in mapped_ucx() if os.path.dirname(p) != ucx_dir]


def _refuse(found: list[str], ucx_dir: str, why: str) -> UCXLibraryError:
    return UCXLibraryError(
        f"{why}: {_describe(found)}, where gpushare needs the UCX in {ucx_dir}. "
        "Two UCX copies cannot share one process: load gpushare's UCX first (make the first "
        "gpushare.ucx object, or open a share over ucx-rma, before importing the library that loads "
        f"the other UCX), or point {LIBRARY_DIR_ENV} at a UCX of the version gpushare was built with"
    )


def load() -> UcxLibraries:
    """Load UCX and libucxx by path, and check what the process then maps.

    Raises :class:`UCXLibraryError` when another UCX is mapped in this
    process, before or after."""
    wheel_ucx, wheel_ucxx = wheel_dirs()
    chosen = os.environ.get(LIBRARY_DIR_ENV)
    ucx_dir = os.path.realpath(chosen) if chosen else wheel_ucx
    if chosen and not os.path.isfile(os.path.join(ucx_dir, "libucp.so.0")):
        raise UCXLibraryError(f"{LIBRARY_DIR_ENV}={chosen!r} holds no libucp.so.0")
    already = _foreign(ucx_dir)
    if already:
        raise _refuse(already, ucx_dir, "another UCX is already loaded in this process")
    handles = []
    for name in _ORDER:
        path = os.path.join(ucx_dir, name)
        try:
            handles.append(ctypes.CDLL(path, os.RTLD_LOCAL))
        except OSError as exc:
            raise UCXLibraryError(f"UCX's {name} could not be loaded from {ucx_dir}: {exc}") from exc
    ucxx_file = os.path.join(wheel_ucxx, "libucxx.so")
    try:
        ctypes.CDLL(ucxx_file, os.RTLD_LOCAL)
    except OSError as exc:
        raise UCXLibraryError(f"libucxx could not be loaded from {ucxx_file}: {exc}") from exc
    after = _foreign(ucx_dir)
    if after:  # pragma: no cover - the loader resolved a NEEDED entry elsewhere
        raise _refuse(after, ucx_dir, "a second UCX was mapped while loading gpushare's")
    version = version_of(handles[-1])
    return UcxLibraries(ucx_dir, version, ucxx_file, tuple(mapped_ucx()))


def check_built(libs: UcxLibraries, built: tuple[int, int]) -> None:
    """Refuse a loaded UCX whose (major, minor) is not ``built``, the one the native module was built against."""
    if libs.ucx_version[:2] != tuple(built):
        raise UCXLibraryError(
            f"UCX {'.'.join(map(str, libs.ucx_version))} was loaded from {libs.ucx_dir}, but gpushare's native "
            f"module was built against UCX {built[0]}.{built[1]}, whose worker-address and remote-key formats "
            f"it validates: reinstall the libucx wheel that libucxx-cu13==0.52.* brings, or point "
            f"{LIBRARY_DIR_ENV} at a UCX {built[0]}.{built[1]}"
        )
