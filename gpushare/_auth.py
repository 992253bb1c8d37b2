"""Peers prove to each other that they hold the same key before anything else.

Every control connection starts with a mutual challenge, in the manner of
:mod:`multiprocessing.connection`: the importer's ``hello`` carries a random
nonce; the exporter answers with a nonce of its own and an HMAC-SHA256 of both
under the key; the importer checks it and answers with its own HMAC before it
sends anything else (a share's token included).  The two proofs are labelled
by role, so one side's answer can never stand for the other's.

The key is, in order: the one given to :func:`gpushare.set_authkey`; the
``GPUSHARE_AUTHKEY`` environment variable (for launchers that start separate
programs: torchrun, mpirun, a job script); else this process's
``multiprocessing.current_process().authkey``, which a program's
multiprocessing children inherit, so a program and its workers trust each
other with no setup.  Shares carry no secret of this kind.

Channels make the same exchange with the channel's token as the key
(``secret=``), as producer and consumer: labels of their own, so a proof
made for a channel never stands for a control connection's, or back.
"""

from __future__ import annotations

import hashlib
import hmac
import multiprocessing
import os
import secrets
import threading

from ._errors import InvalidInputError

__all__ = ["NONCE_BYTES", "key", "new_nonce", "proof", "set_authkey", "verify"]

NONCE_BYTES = 16
_LABELS = {"exporter": b"gpushare control exporter v1", "importer": b"gpushare control importer v1",
           "producer": b"gpushare channel producer v1", "consumer": b"gpushare channel consumer v1"}
_MIN_KEY = 16
_MAX_KEY = 4096
#: What a key must be, as every error about one says.
_RULE = (f"a key must be at least {_MIN_KEY} bytes (at most {_MAX_KEY}), the same in every program that shares "
         "memory, for example python -c 'import secrets; print(secrets.token_hex(32))'")

_lock = threading.Lock()
_key: bytes | None = None


def set_authkey(authkey: bytes | str | None) -> None:
    """Set the key this process's control connections prove they hold.

    Parameters
    ----------
    authkey : bytes, str or None
        At least 16 bytes (a str is taken as UTF-8).  Every exporter and
        importer that talk to each other must hold the same key.  ``None``
        goes back to the default: ``GPUSHARE_AUTHKEY``, else this process's
        multiprocessing authkey (shared by a program and its multiprocessing
        children).

    Raises
    ------
    InvalidInputError
        For a key that is not bytes or str, or not 16 to 4096 bytes long.
    """
    global _key
    with _lock:
        _key = None if authkey is None else _checked(authkey, "authkey")


def _checked(value: object, what: str) -> bytes:
    if isinstance(value, str):
        try:
            value = value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"{what} is not valid UTF-8 text; {_RULE}") from None
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidInputError(f"{what} must be bytes or str, not {type(value).__name__}")
    if not _MIN_KEY <= len(value) <= _MAX_KEY:
        raise InvalidInputError(f"{what} is {len(value)} bytes; {_RULE}")
    return bytes(value)


def key() -> bytes:
    """The key in force for this process (see the module notes).

    Raises
    ------
    InvalidInputError
        ``GPUSHARE_AUTHKEY`` is set but shorter than 16 bytes (or longer
        than 4096): the message names the variable and the rule.
    """
    with _lock:
        if _key is not None:
            return _key
    env = os.environb.get(b"GPUSHARE_AUTHKEY")  # bytes: any value the environment holds is read as it is
    if env is not None:
        return _checked(env, "GPUSHARE_AUTHKEY")
    return bytes(multiprocessing.current_process().authkey)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(role: str, importer_nonce: bytes, exporter_nonce: bytes, *, secret: bytes | None = None) -> bytes:
    """The HMAC the peer in ``role`` sends on a connection with these two
    nonces (the connecting side's first): ``"exporter"`` or ``"importer"``
    under this process's :func:`key`, ``"producer"`` or ``"consumer"`` under
    a channel's token (``secret``)."""
    label = _LABELS.get(role)
    if label is None:
        raise InvalidInputError(f"no proof for role {role!r:.20}")
    return hmac.new(key() if secret is None else secret, label + importer_nonce + exporter_nonce,
                    hashlib.sha256).digest()


def verify(role: str, importer_nonce: bytes, exporter_nonce: bytes, got: object, *,
           secret: bytes | None = None) -> bool:
    """Whether ``got`` is the proof a holder of the key (or of ``secret``) in ``role`` sends."""
    if not isinstance(got, bytes) or len(got) != hashlib.sha256().digest_size:
        return False
    return hmac.compare_digest(proof(role, importer_nonce, exporter_nonce, secret=secret), got)
