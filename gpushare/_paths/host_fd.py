"""The host-fd path: host memory in memfds, shared on one node by handing the
file descriptors over the exporter's broker and mapping them.

A buffer is one or more memfds ("physical allocations", each a multiple of
the page size) mapped back to back in one reservation, so it is contiguous in
both processes.  The memfds are sealed against shrinking and growing, so no
process holding them can make another's mapping fault.

The reservation is a private anonymous mapping owned by a :class:`mmap.mmap`
object (read-write, ``MAP_NORESERVE``: it commits no memory, and every page of
it is replaced at once); each memfd is mapped over it with ``MAP_FIXED``.
Closing the ``mmap`` unmaps the whole range, and ``mmap`` refuses to close
while a ``memoryview`` or NumPy array still uses it, which is what keeps
:meth:`HostBuffer.close` from leaving a dangling view.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._descriptors import MAX_ALLOCATIONS, MAX_SIZE, PosixFdBufferDescriptor
from .._errors import ClosedError, GpuShareError, InvalidInputError, UnsupportedError
from .._memory import check_memfd
from .._process import check_same_node
from .._ranges import Ranges
from .._types import round_up
from . import broker as _broker
from .base import (
    ALLOCATED_HOST,
    Grant,
    Here,
    Mapped,
    Memory,
    Offer,
    Opened,
    Options,
    Path,
    descriptor_of,
    descriptor_payload,
    own_registration,
    same_node,
)

__all__ = ["HostBuffer", "allocate_host", "export_host", "import_host", "containing"]

PAGE = mmap.PAGESIZE
_MAP_NORESERVE = 0x4000  # Linux values; the mmap module does not export these
_MAP_FIXED = 0x10
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; fcntl does not export it
# Fixed size; the set of seals stays open so that seal() can add the write
# seal later (a process holding the fd could add it too, which denies no more
# than the writable fd it holds already allows).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_libc_mmap: Any = None


def _mmap_fixed() -> Any:
    global _libc_mmap
    if _libc_mmap is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.mmap
        fn.restype = ctypes.c_void_p
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc_mmap = fn
    return _libc_mmap


def huge_page_size() -> int:
    """The size of a huge page mapped by one page-table entry (2 MiB on x86-64)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE = huge_page_size()


def _read_only(fds: Sequence[int], seals: Sequence[int] | None = None) -> bool:
    """Whether any of ``fds`` can only be mapped read-only: opened read-only
    (a read-only share's), or sealed against writes (:meth:`HostBuffer.seal`).
    ``seals``: each fd's seals, where the caller read them already."""
    for i, fd in enumerate(fds):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            return True
        if seals is not None:
            sealed = seals[i]
        else:
            try:
                sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                continue
        if sealed & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
            return True
    return False


def _map_contiguously(fds: Sequence[int], sizes: Sequence[int],
                      readonly: bool | None = None) -> tuple[mmap.mmap, int]:
    """Map each fd (whole, from offset 0) back to back; returns the owning
    ``mmap`` and the base address.  A buffer of a huge page or more starts
    on a huge-page boundary, so that huge pages (hugetlb memfds, or
    transparent ones) can back it.  On failure nothing stays mapped.
    ``readonly``: what :func:`_read_only` says of ``fds``, where the caller
    asked it already."""
    total = sum(sizes)
    align = HUGE if total >= HUGE else PAGE
    # An fd opened read-only (a read-only share) maps read-only: the pages
    # cannot be made writable here, by mprotect or otherwise.
    if readonly is None:
        readonly = _read_only(fds)
    prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
    region = mmap.mmap(
        -1,
        total + align - PAGE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    try:
        anchor = ctypes.c_char.from_buffer(region)
        base = round_up(ctypes.addressof(anchor), align)
        del anchor  # releases the buffer export again
        fixed = _mmap_fixed()
        offset = 0
        for i, (fd, size) in enumerate(zip(fds, sizes, strict=True)):
            want = base + offset
            got = fixed(
                want,
                size,
                prot,
                mmap.MAP_SHARED | _MAP_FIXED,
                fd,
                0,
            )
            if got != want:
                err = ctypes.get_errno()
                raise OSError(err, f"mapping allocation {i} ({size} bytes): {os.strerror(err)}")
            offset += size
    except BaseException:
        region.close()
        raise
    return region, base


class _Resources:
    """What a :class:`HostBuffer` owns, kept apart from it so that
    ``weakref.finalize`` can release it without holding the buffer."""

    __slots__ = ("closed", "export", "fds", "lock", "region")

    def __init__(self, region: mmap.mmap, fds: list[int]) -> None:
        self.region = region
        self.fds = fds
        self.export: tuple[_broker.Broker, PosixFdBufferDescriptor] | None = None
        self.lock = threading.Lock()
        self.closed = False

    def release(self, *, strict: bool) -> None:
        """Unmap, stop serving, close fds; once.  ``strict``: raise
        :class:`BufferError` (changing nothing) while views still use the
        memory; otherwise leave the mapping to the last view."""
        with self.lock:
            if self.closed:
                return
            try:
                self.region.close()
            except BufferError:
                if strict:
                    raise BufferError(
                        "the buffer is still used by a memoryview or array; delete those before close()"
                    ) from None
                # The views keep the mmap object, which unmaps when the last goes.
            self.closed = True
            export, self.export = self.export, None
            if export is not None and export[0].pid == os.getpid():
                export[0].revoke(export[1].export_id)
            fds, self.fds = self.fds, []
            for fd in fds:
                os.close(fd)


def _release(resources: _Resources) -> None:
    resources.release(strict=False)


#: Called after any buffer was sealed (the exporter: a kept view of a
#: writable share may not be reopened writable any more; docs/design.md).
_SEAL_HOOKS: list[Any] = []


def on_seal(hook: Any) -> None:
    """Call ``hook()`` after each :meth:`HostBuffer.seal`."""
    _SEAL_HOOKS.append(hook)


class HostBuffer:
    """Host memory that another process on this node can map: made by
    :func:`gpushare.allocate` with ``device="host"`` or returned by
    :func:`gpushare.import_buffer`.

    NumPy views it without a copy (``numpy.asarray(buf)``, through
    ``__array_interface__``); :meth:`memoryview` gives the buffer protocol on
    every Python version, and on 3.12+ ``memoryview(buf)`` works directly.

    :meth:`close` (or leaving a ``with`` block) unmaps the memory, and in the
    exporter stops serving it to new importers and closes its memfds; it runs
    once, and refuses with :class:`BufferError` while a view still uses the
    memory.  A buffer nobody closed is released when it is garbage collected.
    """

    __slots__ = ("__weakref__", "_finalizer", "_huge", "_off", "_ptr", "_readonly", "_res", "_size", "_sizes")

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "HostBuffer cannot be constructed directly; use gpushare.allocate(size, device='host') "
            "or gpushare.import_buffer()"
        )

    @classmethod
    def _create(
        cls, region: mmap.mmap, ptr: int, size: int, sizes: tuple[int, ...], fds: list[int]
    ) -> HostBuffer:
        self = object.__new__(cls)
        self._res = _Resources(region, fds)
        self._ptr = ptr
        anchor = ctypes.c_char.from_buffer(region)
        self._off = ptr - ctypes.addressof(anchor)  # where the buffer starts in its reservation
        del anchor
        self._size = size
        self._sizes = sizes
        self._huge: str | None = None
        self._readonly = False
        self._finalizer = weakref.finalize(self, _release, self._res)
        return self

    def seal(self) -> None:
        """Make the buffer read-only for good everywhere but in this
        process's own mapping (exporter only): no process, this one
        included, can map it writable or write it from now on
        (``F_SEAL_FUTURE_WRITE`` on its memfds).  A read-only share of it
        over host-fd is then read-only by the kernel's rule, not only by the
        importer's (without it, a process of the same user can open a memfd
        it received again, writable, through ``/proc/self/fd``).  Importers
        that mapped it writable before keep their mappings; later writable
        shares of it go over a path that copies.

        Raises
        ------
        UnsupportedError
            An imported buffer, or a kernel without ``F_SEAL_FUTURE_WRITE`` (5.1).
        ClosedError
            A closed buffer.
        """
        res = self._res
        with res.lock:
            if res.closed:
                raise ClosedError("cannot seal a closed host buffer")
            if not res.fds:
                raise UnsupportedError("only the process that allocated a host buffer can seal it")
            try:
                for fd in res.fds:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            except OSError as exc:
                if exc.errno == errno.EPERM:
                    raise UnsupportedError("the buffer's memfds take no more seals: a process holding them (an "
                                           "importer of a writable share) sealed them already") from None
                raise UnsupportedError(f"this kernel cannot seal a memfd against writes ({exc.strerror})") from None
        for hook in _SEAL_HOOKS:
            hook()

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal` ran (in the exporter; read from the memfds)."""
        fds = self._res.fds
        return bool(fds) and all(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _F_SEAL_FUTURE_WRITE for fd in fds)

    @property
    def readonly(self) -> bool:
        """Mapped read-only (imported from a read-only share): the memory
        cannot be written in this process."""
        return self._readonly

    @property
    def huge_pages(self) -> str | None:
        """How the allocation asked for huge pages: ``"hugetlb"`` (reserved
        huge pages, certain), ``"thp"`` (transparent huge pages advised, and
        this system's shmem setting honours the advice), or ``None``."""
        return self._huge

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    nbytes = size

    @property
    def sizes(self) -> tuple[int, ...]:
        """Size of each physical allocation (memfd), in address order."""
        return self._sizes

    @property
    def ptr(self) -> int:
        """Address of the first byte in this process."""
        return self._ptr

    @property
    def device(self) -> str:
        """Always ``"host"``."""
        return "host"

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._res.closed

    @property
    def is_exporter(self) -> bool:
        """Whether this process allocated the buffer (and can export it)."""
        return bool(self._res.fds)

    def _region(self) -> mmap.mmap:
        if self._res.closed:
            raise ClosedError("the host buffer is closed")
        return self._res.region

    def memoryview(self) -> memoryview:
        """A byte view of the buffer (the buffer protocol); read-only where
        the buffer is mapped read-only."""
        view = memoryview(self._region())[self._off : self._off + self._size]
        return view.toreadonly() if self._readonly else view

    def __buffer__(self, flags: int) -> memoryview:
        return self.memoryview()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self._size,),
            "typestr": "|u1",
            "data": self.memoryview(),
            "version": 3,
        }

    def close(self) -> None:
        """Unmap the memory; in the exporter also stop serving it and close
        its memfds.  Idempotent.

        Raises
        ------
        BufferError
            While a memoryview or array still uses the memory; nothing changes.
        """
        self._res.release(strict=True)
        self._finalizer.detach()

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._res.closed else f"ptr=0x{self._ptr:x}"
        return f"<HostBuffer size={self._size} allocations={len(self._sizes)} {state}>"


#: ``huge_pages=`` values of :func:`allocate_host`.
HUGE_PAGES = ("auto", "hugetlb", "thp", False)
_MFD_HUGETLB = 0x0004  # Linux; os does not export it


def shmem_thp() -> str:
    """This system's setting for transparent huge pages in shared memory."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def allocate_host(size: int, *, chunk_size: int | None = None, huge_pages: Any = "auto") -> HostBuffer:
    """A memfd-backed host buffer of ``size`` bytes in allocations of at most
    ``chunk_size`` bytes (a multiple of the page size; one allocation by default).

    ``huge_pages``: ``"auto"`` advises transparent huge pages for a buffer of
    a huge page or more (as NumPy does for its large arrays; they back it
    where the system's shmem setting allows); ``"thp"`` advises them at any
    size; ``"hugetlb"`` takes reserved huge pages (``vm.nr_hugepages``) and
    raises :class:`UnsupportedError` where there are not enough; ``False``
    uses ordinary pages."""
    if huge_pages not in HUGE_PAGES or isinstance(huge_pages, bool) and huge_pages:
        raise InvalidInputError(f"huge_pages is {huge_pages!r}; expected 'auto', 'thp', 'hugetlb' or False")
    if size <= 0 or size >= MAX_SIZE:
        raise InvalidInputError(f"size is {size}; expected 1 to 2**63 - 1")
    unit = HUGE if huge_pages == "hugetlb" else PAGE
    if chunk_size is None:
        chunk = round_up(size, unit)
    else:
        if chunk_size <= 0 or chunk_size % unit:
            raise InvalidInputError(
                f"chunk_size is {chunk_size}; expected a positive multiple of the "
                f"{'huge ' if unit == HUGE else ''}page size {unit}"
            )
        chunk = chunk_size
    count = -(-size // chunk)
    if count > MAX_ALLOCATIONS:
        raise InvalidInputError(
            f"size {size} in chunks of {chunk} makes {count} allocations; at most {MAX_ALLOCATIONS}"
        )
    sizes = [chunk] * (count - 1) + [round_up(size - chunk * (count - 1), unit)]
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (_MFD_HUGETLB if huge_pages == "hugetlb" else 0)
    fds: list[int] = []
    try:
        for n in sizes:
            fd = os.memfd_create("gpushare", flags)
            fds.append(fd)
            os.ftruncate(fd, n)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        region, ptr = _map_contiguously(fds, sizes)
        if huge_pages == "hugetlb":
            _populate(ptr, sum(sizes), write=True)  # reserved pages are taken now, or it fails here
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        if huge_pages != "hugetlb":
            raise
        raise UnsupportedError(
            f"cannot allocate {sum(sizes)} bytes of reserved huge pages ({exc.strerror}): this system has "
            f"{_hugetlb_free()} free huge pages of {HUGE} bytes; reserve more with "
            "`sysctl vm.nr_hugepages=N` (as root), or use huge_pages='thp' or 'auto'"
        ) from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    buf = HostBuffer._create(region, ptr, size, tuple(sizes), fds)
    if huge_pages == "hugetlb":
        buf._huge = "hugetlb"
    elif huge_pages == "thp" or (huge_pages == "auto" and sum(sizes) >= HUGE):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, buf._off, sum(sizes))
        except (OSError, AttributeError) as exc:  # a kernel without transparent huge pages
            if huge_pages == "thp":
                buf.close()
                raise UnsupportedError(f"this kernel offers no transparent huge pages ({exc})") from None
        else:
            if shmem_thp() in ("always", "within_size", "advise", "force"):
                buf._huge = "thp"
    _allocated.add(buf.ptr, buf.ptr + buf.size, None, weakref.ref(buf))
    return buf


def _hugetlb_free() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    return line.split()[1]
    except OSError:
        pass
    return "no"


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23
_madvise: Any = None


def _populate(ptr: int, length: int, *, write: bool) -> None:
    """Fault in ``length`` bytes at ``ptr`` now (page tables and, for a
    write, the pages themselves), in the kernel: no page fault on first use."""
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise = fn
    if _madvise(ptr, length, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            raise OSError(err, os.strerror(err))
        # A kernel before 5.14: touch one byte per page instead.
        raw = (ctypes.c_char * length).from_address(ptr)
        for i in range(0, length, PAGE):
            if write:
                raw[i] = raw[i]
            else:
                raw[i]  # noqa: B018 - the read is the point


def prefault(buf: HostBuffer) -> None:
    """Fault in every page of an imported (or allocated) buffer now, so that
    the first copy or store pays no page faults.  A read fault is enough:
    a shared mapping of shared memory gets writable entries from it, and
    it maps pages that are already there around each fault."""
    if buf.is_closed:
        raise ClosedError("the host buffer is closed")
    try:
        _populate(buf.ptr, sum(buf.sizes), write=False)
    except OSError as exc:
        raise GpuShareError(f"could not fault in the mapping ({exc.strerror})") from None


def _exportable(buf: HostBuffer) -> bool:
    res = buf._res
    return not res.closed and bool(res.fds)


#: Buffers this process allocated (and can export), by address, to find the one an array lies
#: in (the same lookup for every array of a state dict: by bisection, not buffer by buffer).
_allocated = Ranges(_exportable)


def containing(address: int, nbytes: int) -> tuple[HostBuffer, int] | None:
    """The open buffer this process allocated that holds ``nbytes`` bytes at
    ``address`` (an array over it, a slice, a typed view), and their offset in it."""
    for ref in _allocated.candidates(address, nbytes, None):
        buf = ref()
        if buf is not None and _exportable(buf) and buf.ptr <= address and address + nbytes <= buf.ptr + buf.size:
            return buf, address - buf.ptr
    return None


def export_host(buf: HostBuffer) -> PosixFdBufferDescriptor:
    """The descriptor that lets another process on this node map ``buf``;
    the same one on every call in this process."""
    res = buf._res
    with res.lock:
        _check_exportable(res)
        if res.export is not None and res.export[0].pid == os.getpid():
            return res.export[1]
        broker, desc = _broker.publish(
            res.fds, device="host", sizes=buf.sizes, size=buf.size, owner_uuid=None
        )
        res.export = (broker, desc)
        return desc


def share_fds(buf: HostBuffer) -> list[int]:
    """The memfds of a buffer this process allocated, for a share's own
    registration (borrowed: the buffer keeps them)."""
    res = buf._res
    with res.lock:
        _check_exportable(res)
        return list(res.fds)


def _check_exportable(res: _Resources) -> None:
    if res.closed:
        raise ClosedError("cannot export a closed host buffer")
    if not res.fds:
        raise UnsupportedError("this host buffer was imported; only the process that allocated it can export it")


def import_host(
    desc: PosixFdBufferDescriptor, *, timeout: float = _broker.TIMEOUT, fds: list[int] | None = None
) -> HostBuffer:
    """Fetch the memfds behind ``desc`` from its exporter and map them.

    ``fds``: the memfds, already received from the exporter (over its
    same-node control socket); they are checked the same way, and closed
    here whatever happens.
    """
    try:
        check_same_node(desc)
        for i, size in enumerate(desc.sizes):
            if size % PAGE:
                raise InvalidInputError(
                    f"allocation size {i} is {size}; host allocations are multiples of the page size {PAGE}"
                )
        if fds is None:
            fds = _broker.fetch_fds(
                desc.address, desc.export_id, desc.token, len(desc.sizes), pid=desc.pid, timeout=timeout
            )
        elif len(fds) != len(desc.sizes):
            raise InvalidInputError(
                f"exporter pid {desc.pid} sent {len(fds)} file descriptors; the descriptor names {len(desc.sizes)}"
            )
        seals = [_check_memfd(fd, i, size) for i, (fd, size) in enumerate(zip(fds, desc.sizes, strict=True))]
        readonly = _read_only(fds, seals)
        region, ptr = _map_contiguously(fds, desc.sizes, readonly)
    finally:
        for fd in fds or ():
            os.close(fd)  # the mappings keep the memory; the fds are not needed
    buf = HostBuffer._create(region, ptr, desc.size, desc.sizes, [])
    buf._readonly = readonly
    return buf


def _check_memfd(fd: int, index: int, size: int) -> int:
    """Refuse an fd that is not a memfd of ``size`` bytes sealed against
    shrinking; returns its seals."""
    return check_memfd(fd, size, f"file descriptor {index}", "the descriptor says")


class HostFd(Path):
    """The host-fd path: host memory from gpushare.allocate mapped on this
    node through its memfds (sent over the exporter's Unix control socket,
    else fetched from its broker)."""

    name = "host-fd"
    rank = 4
    mapped = True
    holds_memory = True
    reopens = True
    maps_strided = True
    serves = frozenset({ALLOCATED_HOST})
    reason = "same node; host memory mapped through memfds"

    def offer(self, memory: Memory) -> Offer | None:
        buf = memory.obj
        # A sealed buffer maps only read-only: shared writable, it goes by copies (cma).
        if not isinstance(buf, HostBuffer) or not (memory.readonly or not buf.sealed):
            return None
        fds = share_fds(buf)
        return own_registration(fds, device="host", sizes=buf.sizes, size=buf.size, owner_uuid=None,
                                readonly=memory.readonly)

    def holder(self, obj: Any, memory_type: str, span: tuple[int, int]) -> tuple[Any, int] | None:
        if memory_type != "host" or isinstance(obj, HostBuffer):
            return None
        return containing(*span)

    def on_seal(self, hook: Callable[[], None]) -> None:
        on_seal(hook)

    def grant_fds(self, export: Any) -> int:
        desc = export.descriptors[self.name]
        return sum(len(fds) for export_id, fds in export.registrations if export_id == desc.export_id)

    def serve(self, export: Any, session: Any) -> Grant:
        if not export.readonly and any(fds and _read_only(fds) for _, fds in export.registrations):
            raise UnsupportedError("the buffer was sealed after this share was made: it maps only "
                                   "read-only now (export it again: a writable share of a sealed "
                                   "buffer goes over cma)")
        grant = Grant(descriptor_payload(export, self.name))
        if session.local:
            # The fds the descriptor names, checked as the broker checks them;
            # none if the registration was withdrawn (the importer then asks
            # the broker, and hears why).
            desc = export.descriptors[self.name]
            try:
                grant.fds = _broker.grant(desc.export_id, desc.token) or []
            except OSError as exc:  # out of descriptors: this open is refused, the connection stays
                raise UnsupportedError(f"the exporter cannot duplicate the buffer's memfds: {exc.strerror}") from None
        return grant

    def not_offered(self, share: Any) -> str | None:
        if share.device == "host":
            return "not host-fd: not offered, the memory is not from gpushare.allocate(device='host')"
        return None

    def unavailable(self, share: Any, here: Here) -> str | None:
        if not same_node(share, here):
            return "exporter is on another node (or network namespace)"
        return None

    def open(self, share: Any, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        desc = descriptor_of(share, grant, (PosixFdBufferDescriptor,))
        if desc.device != "host":
            raise InvalidInputError("exporter sent a descriptor of CUDA memory with a host-fd offer")
        if fds:
            given = list(fds)
            fds.clear()  # import_host owns them now
            mapped = import_host(desc, fds=given)
        else:
            mapped = import_host(desc, timeout=how.timeout)
        if how.prefault:
            try:
                prefault(mapped)
            except BaseException:
                mapped.close()
                raise
        return Opened(mapping=Mapped.host(mapped))


PATH: Path = HostFd()
