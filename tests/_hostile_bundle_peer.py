"""The hostile exporter of tests/test_fuzz_bundle_hostile.py: a real exporter
process that exports a bundle and answers every open of it, over its real
control socket, with the reply altered as it is told (``forge``): the
payload's items replaced, other fds sent in place of its memfds, another
share's grant, or the reply frame itself changed (another request's id, fds
announced and not sent, cut short, never sent).  The lease each open made is
the exporter's own, so that the test can check it ends."""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from typing import Any

FORGERY: dict[str, Any] = {}


def setup() -> dict:
    import numpy as np

    import gpushare as gs
    from gpushare._exporter import registry

    a, b, c = gs.empty(2 * 4096, "uint8"), gs.empty(4096, "uint8"), np.zeros(4096, np.uint8)
    a[:], b[:], c[:] = 1, 2, 3
    small = gs.empty(4096, "uint8")
    small[:] = 4
    shares = {"bundle": gs.export({"a": a, "b": b}, lifetime="revoked"),
              "mixed": gs.export({"a": a, "b": b, "c": c}, lifetime="revoked"),
              "pair": gs.export({"s": small, "t": gs.empty(4096, "uint8")}, lifetime="revoked"),
              "single": gs.export(small, lifetime="revoked")}
    state = {"_handlers": HANDLERS, "keep": (a, b, c, small), "shares": shares,
             "exports": {k: registry.registered(s) for k, s in shares.items()},
             "_reply": {"pid": os.getpid(), "shares": shares}}
    _install(state)
    return state


# ---------------------------------------------------------------- what is sent instead


def _fd(kind: str, real: list[int], state: dict, session: Any) -> int:
    """One fd of ``kind`` to send (a new one: the connection closes it once sent)."""
    if kind.startswith("real:"):
        return os.dup(real[int(kind[5:]) % len(real)])
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r
    if kind == "dir":
        return os.open(tempfile.gettempdir(), os.O_RDONLY | os.O_DIRECTORY)
    if kind == "devnull":
        return os.open(os.devnull, os.O_RDWR)
    if kind == "socket":
        a, b = socket.socketpair()
        b.close()
        return a.detach()
    if kind.startswith("memfd:"):  # memfd:SIZE[:sealed]
        _, size, *sealed = kind.split(":")
        fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, int(size))
        if sealed:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return fd
    if kind == "other":  # a memfd of another share's memory
        grant = _real_serve(state, "pair", "host-fd,host-fd", session)
        try:
            return os.dup(grant.fds[0])
        finally:
            for fd in grant.fds:
                os.close(fd)
            _end(grant)
    raise ValueError(kind)


def _set(payload: Any, at: tuple, value: Any, genuine: Any) -> Any:
    """``payload`` with the item at ``at`` replaced by ``value`` (``"<delete>"``:
    removed; ``{"<copy>": path}``: the genuine payload's item there; an index
    one past a list's end appends).  A place the payload lacks is left alone
    (a fallback's grant has another shape)."""
    if isinstance(value, dict) and set(value) == {"<copy>"}:
        try:
            value = _walk(genuine, tuple(value["<copy>"]))
        except (KeyError, IndexError, TypeError):
            return payload
        value = copy.deepcopy(value)
    if not at:
        return value
    try:
        node = _walk(payload, at[:-1])
        last = at[-1]
        if value == "<delete>":
            del node[last]
        elif isinstance(node, list) and last == len(node):
            node.append(value)
        elif isinstance(node, dict) or (isinstance(node, list) and type(last) is int and -len(node) <= last < len(node)):
            node[last] = value
    except (KeyError, IndexError, TypeError):
        pass
    return payload


def _walk(value: Any, at: tuple) -> Any:
    for step in at:
        value = value[step]
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _real_serve(state: dict, name: str, paths: str, session: Any) -> Any:

    export = state["exports"][name]
    with export.lock:
        return state["real_serve"](export, paths if export.parts is not None else paths.split(",")[0], session)


def _end(grant: Any) -> None:
    from gpushare import _exporter

    _exporter.sessions._ended(grant)


def _install(state: dict) -> None:
    """Wrap the exporter's grant of an open (``_serve``) and its open reply
    (``_Session._open``) to apply :data:`FORGERY` to the bundle's opens."""
    from gpushare import _exporter

    real_serve = state["real_serve"] = _exporter.sessions._serve
    real_open = _exporter.sessions.Session._open
    targets = (state["exports"]["bundle"], state["exports"]["mixed"])

    def serve(export: Any, path: str, session: Any) -> Any:
        grant = real_serve(export, path, session)
        if all(export is not t for t in targets) or grant is None or not FORGERY:
            return grant
        state["served"] += 1
        forged = FORGERY
        genuine = _thaw(grant.payload)
        payload, fds = copy.deepcopy(genuine), list(grant.fds)
        if "other" in forged:  # another share's grant (its payload and fds) in place of this one's
            name, paths = forged["other"]
            other = _real_serve(state, name, paths, session)
            for fd in fds:
                os.close(fd)
            payload, fds = _thaw(other.payload), list(other.fds)
            _end(other)
        for at, value in forged.get("edits", ()):
            payload = _set(payload, tuple(at), value, genuine)
        if "fds" in forged:
            kinds = forged["fds"]
            made = [_fd(kind, fds, state, session) for kind in kinds]
            for fd in fds:
                os.close(fd)
            fds = made
        grant.payload, grant.fds = payload, fds
        return grant

    def open_(session: Any, conn: Any, rid: Any, msg: dict) -> None:
        frame = FORGERY.get("frame")
        if frame is None or all(msg.get("share") != t.share_id for t in targets):
            return real_open(session, conn, rid, msg)
        return real_open(session, _Conn(conn, frame), rid, msg)

    _exporter.sessions._serve = serve
    _exporter.sessions.Session._open = open_
    state["served"] = 0


class _Conn:
    """The exporter's connection, with the one open reply sent through it altered."""

    def __init__(self, conn: Any, how: str) -> None:
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_how", how)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)

    def send(self, data: bytes, fds: Any = ()) -> None:
        import json
        import struct

        from gpushare import _control

        conn, how = self._conn, self._how
        message = json.loads(data[4:])
        if how == "silent":  # the lease is made, the reply never sent
            for fd in fds:
                os.close(fd)
            return
        if how == "close":  # the connection ends instead of the reply
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        if how.startswith("cut:"):  # the first N bytes of the reply, then the connection ends
            n = max(1, min(int(how[4:]), len(data) - 1))
            conn.send(data[:n], fds if fds and n else ())
            conn.close_when_sent()
            return
        if how == "bad-length":  # a frame longer than any may be
            for fd in fds:
                os.close(fd)
            conn.send(struct.pack("!I", _control.MAX_FRAME + 1) + data[4:])
            return
        if how == "not-json":
            conn.send(struct.pack("!I", len(data) - 4) + b"\xff" * (len(data) - 4), fds)
            return
        if how == "twice":  # the reply, then the same reply again (fds once)
            conn.send(data, fds)
            conn.send(data)
            return
        if how.startswith("split:"):  # the grant split over frames, as a grant too long for one is, and altered
            self._send_split(message, how[6:], fds)
            return
        if how.startswith("id:"):  # the reply of another request (its id moved by N)
            message["id"] = (message.get("id") or 0) + int(how[3:])
        elif how.startswith("announce:"):  # says it sends N fds more (or fewer) than it does
            message["fds"] = message.get("fds", 0) + int(how[9:])
        elif how.startswith("lease:"):
            message["lease"] = json.loads(how[6:])
        elif how.startswith("set:"):  # a top-level field of the reply replaced: set:NAME=JSON
            name, value = how[4:].split("=", 1)
            message[name] = json.loads(value)
        else:
            raise ValueError(how)
        conn.send(_control.pack(message), fds)


    def _send_split(self, message: dict, kind: str, fds: Any) -> None:
        """The reply as a first frame with allocation 0's grant and ``more``, then
        continuation frames with the rest (the fds with the first), altered by ``kind``."""
        from gpushare import _control

        payload = message.get("payload")
        if not (isinstance(payload, dict) and isinstance(payload.get("parts"), list)
                and isinstance(payload.get("fds"), list) and len(payload["parts"]) > 1):
            self._conn.send(_control.pack(message), fds)  # an edit left nothing to split: sent as it is
            return
        parts, counts = list(payload["parts"]), list(payload["fds"])
        first = {**message, "payload": {**payload, "parts": parts[:1], "fds": counts[:1]}, "more": 1}
        cont: dict = {"id": message.get("id"), "cont": {"parts": parts[1:], "fds": counts[1:]}}
        conts = [cont]
        if kind.startswith("more="):  # announces another number of frames
            first["more"] = json_value(kind[5:])
        elif kind == "short":  # the continuation never comes
            conts = []
        elif kind == "twice":  # one continuation too many
            conts = [cont, cont]
        elif kind == "wrong-id":
            cont["id"] = (cont["id"] or 0) + 1
        elif kind == "extra":  # more items than the allocations asked for
            cont["cont"] = {"parts": parts[1:] + parts, "fds": counts[1:] + counts}
        elif kind == "empty":
            cont["cont"] = {"parts": [], "fds": []}
        elif kind == "uneven":
            cont["cont"]["fds"] = []
        elif kind == "dict":
            cont["cont"]["parts"] = {"1": parts[1]}
        elif kind == "extra-key":
            cont["cont"]["lease"] = [1]
        elif kind == "extra-field":
            cont["lease"] = 7
        elif kind == "no-lists":  # the first frame lacks its lists
            del first["payload"]["fds"]
        elif kind != "genuine":
            raise ValueError(kind)
        self._conn.send(b"".join([_control.pack(first)] + [_control.pack(c) for c in conts]), fds)


def json_value(text: str) -> Any:
    import json

    return json.loads(text)


# ---------------------------------------------------------------- commands


def _forge(state: dict, forgery: dict) -> None:
    FORGERY.clear()
    FORGERY.update(forgery)
    state["served"] = 0


def _status(state: dict) -> dict:
    from gpushare._exporter.registry import get_exporter

    stats = get_exporter().stats()
    return {"leases": stats["leases"], "sessions": stats["sessions"], "served": state["served"],
            "opens": {k: e.opens for k, e in state["exports"].items()}, "fds": len(os.listdir("/proc/self/fd"))}


HANDLERS = {"forge": _forge, "status": _status}
