"""Namespace keys: ``DATA/ns/<namespace>/keys/<key_id hex>`` holds JSON
{"namespace", "role", "secret" hex, "created" unix seconds}, written atomically, mode 0600.

The running server reads a key file at each AUTH and stats it before every request of a
connection authenticated with it, so ``keygen``, ``keys list`` and ``keys revoke`` work on a
live data directory: a revoked key's connections are refused at their next request."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass

from sos_wire.names import BadName, validate_namespace

from .durable import makedirs_durable, unlink_durable, write_file_durable

__all__ = ["ROLES", "ROLE_APPEND", "ROLE_READ", "ROLE_TOKEN", "KeyInfo", "KeyRecord", "KeyStore"]

log = logging.getLogger(__name__)

ROLE_APPEND = "append"
ROLE_READ = "read"
#: a gateway client's key: AUTH succeeds (so ``sos gateway`` can check it and issue an append
#: bearer token), every later request but PING is FORBIDDEN (protocol.md 1.6)
ROLE_TOKEN = "token"
ROLES = (ROLE_APPEND, ROLE_READ, ROLE_TOKEN)


@dataclass
class KeyRecord:
    key_id: bytes
    secret: bytes
    role: str
    namespace: str


@dataclass(frozen=True)
class KeyInfo:
    """What ``keys list`` shows of a key: never its secret. *created* is unix seconds (the
    file's mtime for keys made before it was recorded); *role* is None when the file is
    unreadable (*problem* says why)."""

    namespace: str
    key_id: str
    role: str | None
    created: float
    problem: str | None = None


_KEY_ID = re.compile(r"[0-9a-f]{16}\Z")


class KeyStore:
    """The key files of every namespace under a data directory (a mixin of Storage)."""

    def ns_path(self, namespace: str) -> str:
        raise NotImplementedError

    def keygen(self, namespace: str, role: str) -> str:
        """Create a key for *namespace* with *role*; returns ``<key_id hex>.<secret hex>``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        validate_namespace(namespace)
        key_id, secret = secrets.token_bytes(8), secrets.token_bytes(32)
        kdir = os.path.join(self.ns_path(namespace), "keys")
        makedirs_durable(kdir)
        makedirs_durable(os.path.join(self.ns_path(namespace), "objects"))
        body = json.dumps(
            {"role": role, "secret": secret.hex(), "namespace": namespace, "created": round(time.time(), 3)}
        ).encode()
        write_file_durable(os.path.join(kdir, key_id.hex()), body, mode=0o600)
        return f"{key_id.hex()}.{secret.hex()}"

    def get_key(self, namespace: str, key_id: bytes) -> KeyRecord | None:
        """The key *key_id* of *namespace*, read from disk (so keygen works while serving)."""
        try:
            validate_namespace(namespace)
        except BadName:
            return None
        path = os.path.join(self.ns_path(namespace), "keys", bytes(key_id).hex())
        try:
            with open(path, "rb") as f:
                rec = json.loads(f.read())
            return KeyRecord(bytes(key_id), bytes.fromhex(rec["secret"]), rec["role"], namespace)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.error("unreadable key file %s: %s", path, exc)
            return None

    def _key_path(self, namespace: str, key_id: bytes) -> str:
        """The key file's path, built once per key (sessions stat it before every request)."""
        paths: dict[tuple[str, bytes], str] = self.__dict__.setdefault("_key_paths", {})
        k = (namespace, bytes(key_id))
        path = paths.get(k)
        if path is None:
            if len(paths) >= 4096:
                paths.clear()
            path = paths[k] = os.path.join(self.ns_path(namespace), "keys", k[1].hex())
        return path

    def key_state(self, namespace: str, key_id: bytes) -> tuple[int, ...] | None:
        """A fingerprint of the key's file (one stat), None if it is gone. Sessions compare it
        before each request, so that removing or rewriting a key ends the sessions opened with it."""
        try:
            st = os.stat(self._key_path(namespace, key_id))
        except (BadName, OSError):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def list_keys(self, namespace: str | None = None) -> list[KeyInfo]:
        """Every key of *namespace* (all namespaces if None), by namespace then key id; reads
        only (safe while the server runs). Files that are not key files are skipped."""
        if namespace is not None:
            path = self.ns_path(namespace)
            spaces = [(namespace, path)] if os.path.isdir(path) else []
        else:
            base = self._ns_root()
            try:
                entries = sorted(os.listdir(base))
            except FileNotFoundError:
                entries = []
            spaces = []
            for entry in entries:
                try:
                    validate_namespace(entry)
                except BadName:
                    continue
                spaces.append((entry, os.path.join(base, entry)))
        out: list[KeyInfo] = []
        for ns, path in spaces:
            kdir = os.path.join(path, "keys")
            try:
                names = sorted(os.listdir(kdir))
            except FileNotFoundError:
                continue
            for fn in names:
                if _KEY_ID.match(fn):
                    out.append(self._key_info(ns, os.path.join(kdir, fn), fn))
        return out

    @staticmethod
    def _key_info(namespace: str, path: str, key_id: str) -> KeyInfo:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                rec = json.loads(f.read())
            role = rec["role"]
            created = rec.get("created", st.st_mtime)
            if role not in ROLES or not isinstance(created, (int, float)):
                raise ValueError(f"role {role!r}, created {created!r}")
            return KeyInfo(namespace, key_id, role, float(created))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                mtime = 0.0
            return KeyInfo(namespace, key_id, None, mtime, f"unreadable key file: {exc}")

    def revoke(self, namespace: str, key_id: str) -> None:
        """Remove key *key_id* (16 hex digits) of *namespace* durably (the file's unlink and
        its directory synced). A running server refuses the key's next AUTH and the next
        request of every connection authenticated with it (AUTH_FAILED, closed). ValueError
        for a malformed id, FileNotFoundError if the namespace has no such key."""
        validate_namespace(namespace)
        kid = key_id.strip().lower()
        if "." in kid:
            raise ValueError("give the key id (the part before the '.'), not the whole key: the secret stays secret")
        if not _KEY_ID.match(kid):
            raise ValueError(f"a key id is 16 hex digits (as `sos-server keys list` shows), not {key_id!r}")
        path = os.path.join(self.ns_path(namespace), "keys", kid)
        if not os.path.exists(path):
            raise FileNotFoundError(f"namespace {namespace!r} has no key {kid}")
        unlink_durable(path)

    def _ns_root(self) -> str:
        raise NotImplementedError
