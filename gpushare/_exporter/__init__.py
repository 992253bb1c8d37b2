"""The exporter's side of :func:`gpushare.export`: registry, control channel, lifetimes.

Started on the first export (never on import of gpushare): a TCP listener
served by the process's service thread (:mod:`gpushare._service`), like every
control connection and every lease.  An importer keeps one control
connection to this exporter for all its opens; each open it makes is a
*lease*, a record on that connection, ended by a ``close`` message or by the
connection ending (the importer closed it or died: the kernel reports it).
An export whose lifetime ended (retired, revoked, its object gone) leaves the
registry, and its fd registrations are withdrawn; a small bounded memory of
ended shares lets a late open hear why.  In a forked child the parent's
exporter is never used: the child starts its own on its first export.
"""

from __future__ import annotations

__all__: list[str] = []  # each name is imported from the module that defines it
